"""The learning-speed bench's `--resume`: a long grid spread over several sittings runs each point once,
and never mixes in runs made with other settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import learning_speed
from bench.learning_speed_report import ArmRun


@pytest.fixture()
def partial(tmp_path: Path) -> Path:
    """Where the finished runs are saved (bench/results/<name>.partial.json in a real sitting)."""
    return tmp_path / "results" / "select.partial.json"


@pytest.fixture()
def ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, float]]:
    """Each run the bench starts, in order; the runs themselves are replaced by an empty result (the arms'
    real processes are what the bench measures, not what this test is about)."""
    started: list[tuple[str, int, float]] = []

    def run_arm(spec: learning_speed.RunSpec, out: Path) -> ArmRun:
        started.append((spec.arm, spec.seed, spec.lr))
        return ArmRun(spec.arm, spec.seed, spec.lr, spec.split, spec.minutes * 60, order=spec.order)

    monkeypatch.setattr(learning_speed, "OUT_DIR", tmp_path)
    monkeypatch.setattr(learning_speed, "run_arm", run_arm)
    return started


def _grid(minutes: float = 8.0) -> list[learning_speed.RunSpec]:
    return [learning_speed.RunSpec(arm, seed, lr, minutes, 90.0, 32, "validation", 0)
            for seed in (100, 101) for lr in (1e-4, 2e-4) for arm in ("trl-hf", "tracetrain-vllm")]


def test_a_resumed_grid_runs_only_the_points_an_earlier_sitting_did_not(ran: list[tuple[str, int, float]],
                                                                        partial: Path) -> None:
    grid = _grid()
    first, _ = learning_speed.run_all(grid[:3], "select", partial)  # the first sitting ends after 3 runs
    runs, commits = learning_speed.run_all(grid, "select", partial, resume=True)
    assert ran == [(s.arm, s.seed, s.lr) for s in grid[:3] + grid[3:]]  # nothing twice
    assert [(r.arm, r.seed, r.lr) for r in runs] == [(s.arm, s.seed, s.lr) for s in grid]
    assert runs[:3] == first and len(commits) == 1


def test_runs_made_with_other_settings_are_not_kept(ran: list[tuple[str, int, float]], partial: Path) -> None:
    learning_speed.run_all(_grid(minutes=1.5)[:2], "select", partial)
    learning_speed.run_all(_grid(), "select", partial, resume=True)
    assert len(ran) == 2 + len(_grid())  # the 1.5-minute runs do not stand in for 8-minute ones


def test_without_resume_every_point_runs_again(ran: list[tuple[str, int, float]], partial: Path) -> None:
    learning_speed.run_all(_grid()[:2], "select", partial)
    learning_speed.run_all(_grid()[:2], "select", partial)
    assert len(ran) == 4
