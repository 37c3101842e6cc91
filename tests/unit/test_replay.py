"""Self-imitation's buffer: what it keeps, what it draws, with which advantage, and for how long."""

from __future__ import annotations

import pytest

from tracetrain.config import TrainConfig
from tracetrain.trainer.algorithms.baseline import RunningBaseline
from tracetrain.trainer.algorithms.replay import SuccessReplay
from tracetrain.trainer.data import Sample


def _sample(name: str, group: str, reward: float) -> Sample:
    return Sample(name, group, [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], reward)


def test_only_samples_that_did_better_than_expected_are_kept() -> None:
    replay = SuccessReplay(per_step=8, max_age=4)
    samples = [_sample("win", "g", 1.0), _sample("lose", "g", 0.0), _sample("flat", "h", 0.0)]
    replay.keep(samples, [0.5, -0.5, 0.0], version=0)
    drawn, advantages = replay.draw(1, RunningBaseline(overall=0.1))
    assert [s.session_id for s in drawn] == ["win"]
    assert advantages == pytest.approx([0.9])  # R - V, V the baseline as it stands now, not when kept


def test_a_success_is_no_longer_replayed_once_its_group_succeeds_that_often() -> None:
    replay = SuccessReplay(per_step=8, max_age=100)
    replay.keep([_sample("win", "g", 1.0)], [0.5], version=0)
    baseline = RunningBaseline(momentum=0.5)
    baseline.update("g", 0.0)
    assert [s.session_id for s in replay.draw(1, baseline)[0]] == ["win"]
    baseline.update("g", 1.0)
    baseline.update("g", 1.0)
    baseline.update("g", 1.0)  # the policy now succeeds here nearly every time
    assert replay.draw(2, baseline)[0] == [_sample("win", "g", 1.0)]  # 1.0 - 0.875 is still above
    for _ in range(40):
        baseline.update("g", 1.0)
    _, advantages = replay.draw(3, baseline)
    assert all(a < 1e-9 for a in advantages)  # R - V is all but zero: replaying it moves nothing


def test_draws_are_capped_per_step_and_end_after_max_age() -> None:
    replay = SuccessReplay(per_step=2, max_age=2, seed=3)
    replay.keep([_sample(f"old{i}", f"o{i}", 1.0) for i in range(3)], [1.0] * 3, version=0)
    replay.keep([_sample(f"new{i}", f"n{i}", 1.0) for i in range(3)], [1.0] * 3, version=1)
    baseline = RunningBaseline(overall=0.0)
    drawn, _ = replay.draw(2, baseline)
    assert len(drawn) == 2  # of six within age
    drawn, _ = replay.draw(3, baseline)  # version 0's are 3 versions old now: gone
    assert len(drawn) == 2 and all(s.session_id.startswith("new") for s in drawn)
    assert len(replay.kept) == 3
    assert replay.draw(9, baseline) == ([], []) and not replay.kept


def test_larger_surprises_are_drawn_more_often() -> None:
    replay = SuccessReplay(per_step=1, max_age=10_000, seed=0)
    replay.keep([_sample("big", "big", 1.0), _sample("small", "small", 1.0)], [1.0, 1.0], version=0)
    baseline = RunningBaseline(by_group={"big": 0.1, "small": 0.8})  # advantages 0.9 and 0.2
    drawn = [replay.draw(1, baseline)[0][0].session_id for _ in range(2000)]
    assert 0.75 < drawn.count("big") / len(drawn) < 0.88  # P(big first) = 0.9 / (0.9 + 0.2) = 0.82


def test_replay_is_refused_for_algorithms_without_a_policy_loss() -> None:
    with pytest.raises(ValueError, match="replay_successes .* needs train.algorithm rl, not sft"):
        TrainConfig(algorithm="sft", replay_successes=4)
