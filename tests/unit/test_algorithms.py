"""Our own algorithms on hand-computed values, and the glue to verl's registries."""

from __future__ import annotations

import math

import pytest
import torch

from tracetrain.trainer.algorithms.baseline import RunningBaseline
from tracetrain.trainer.algorithms.dpo import dpo_loss, preference_pairs
from tracetrain.trainer.algorithms.importance import staleness_floor, truncated_is_weights
from tracetrain.trainer.algorithms.sft import select_for_sft, sft_loss


def test_running_baseline_by_hand() -> None:
    baseline = RunningBaseline(momentum=0.5)
    assert baseline.advantage("a", 1.0) == 1.0  # nothing seen yet: baseline 0
    assert baseline.value("a") == 1.0
    assert baseline.advantage("a", 0.0) == -1.0
    assert baseline.value("a") == 0.5
    assert baseline.value("unseen") == pytest.approx(0.5)  # falls back to the overall average
    restored = RunningBaseline.from_state(baseline.state_dict())
    assert restored.value("a") == 0.5 and restored.overall == baseline.overall


def test_truncated_importance_weights_by_hand() -> None:
    old = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]])
    behaviour = torch.tensor([[math.log(0.25), math.log(0.9), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = truncated_is_weights(old, behaviour, mask, cap=1.5)
    assert weights.tolist()[0] == pytest.approx([1.5, 1.0, 0.0])  # ratio 2 capped; masked position 0
    assert not weights.requires_grad


def test_staleness_rule() -> None:
    assert staleness_floor(5, 0) == 5  # on-policy only
    assert staleness_floor(5, 2) == 3  # versions 3, 4 and 5 are within two steps


def test_sft_selection_and_loss_by_hand() -> None:
    assert select_for_sft([0.0, 1.0, 0.5, 1.0], 1.0) == [1, 3]
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(sft_loss(logprobs, mask)) == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    # Split into micro-batches with the global count, the parts add up to the whole.
    parts = sft_loss(logprobs[:1], mask[:1], 3) + sft_loss(logprobs[1:], mask[1:], 3)
    assert float(parts) == pytest.approx(2.0)


def test_dpo_pairs_and_loss_by_hand() -> None:
    groups = {"g1": [(0, 1.0), (1, 0.0), (2, 0.5)], "g2": [(3, 1.0), (4, 1.0)], "g3": [(5, 0.2)]}
    assert preference_pairs(groups) == [(0, 1)]
    loss = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))))  # margin 2, beta 0.5
