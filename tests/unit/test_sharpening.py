"""The sharpening diagnostic: distinct completions, sampled-token logprob and all-equal groups per window."""

from __future__ import annotations

from typing import Any

import pytest

from bench.sharpening import windows


def _row(group: str, version: int, answer: str, reward: float, logprob: float, *, final: bool = True) -> dict[str, Any]:
    """An export row shaped as `tracetrain.store.export` writes it: two prompt tokens, two sampled ones."""
    return {"group_id": group, "segment": 0, "final": final, "reward": reward,
            "loss_mask": [0, 0, 1, 1], "logprobs": [0.0, 0.0, logprob, logprob],
            "policy_versions": [-1, -1, version, version], "completion": [{"role": "assistant", "content": answer}]}


def test_a_collapsing_policy_shows_fewer_answers_surer_tokens_and_flat_groups() -> None:
    rows = [_row("a", 0, "7", 1.0, -1.0), _row("a", 0, "8", 0.0, -2.0), _row("a", 1, " 9 ", 0.0, -1.5),
            _row("b", 2, "5", 0.0, -1.0), _row("b", 2, "6", 1.0, -1.0),
            _row("c", 5, "10", 0.5, -0.1), _row("c", 6, "10", 0.5, -0.1), _row("c", 6, "10 ", 0.5, -0.1),
            _row("d", 7, "4", 0.0, -0.2), _row("d", 7, "3", 1.0, -0.2),
            _row("held-out", 6, "1", 0.0, -3.0, final=False)]  # never rewarded: an evaluation, left out
    early, late = windows(rows, width=5)
    assert (early.first, early.last, early.groups) == (0, 4, 2)
    assert early.distinct == pytest.approx(2.5) and early.all_equal == 0.0
    assert early.logprob == pytest.approx((-1 - 2 - 1.5 - 1 - 1) / 5)
    assert (late.first, late.groups) == (5, 2)
    assert late.distinct == pytest.approx(1.5)  # "10" and "10 " are one answer
    assert late.all_equal == pytest.approx(0.5) and late.logprob == pytest.approx((-0.1 * 3 - 0.2 * 2) / 5)
    assert late.reward == pytest.approx((0.5 * 3 + 0 + 1) / 5)


def test_a_group_belongs_to_the_window_of_its_first_sampling_version() -> None:
    rows = [_row("a", 4, "1", 0.0, -1.0), _row("a", 5, "2", 1.0, -1.0)]
    (only,) = windows(rows, width=5)
    assert (only.first, only.groups) == (0, 1)
