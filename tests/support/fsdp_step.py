"""One training step compared across backends: the batch, the configuration, the local reference and the
comparisons that tests/integration/test_fsdp.py (which explains the tolerances) and
test_fsdp_ray_cluster.py share."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tracetrain.config import TrainConfig
from tracetrain.trainer.data import Sample
from tracetrain.trainer.local_backend import LocalBackend

LR = 1e-3
"""The learning rate of `train_config`: one step moves a weight by about this much."""
WEIGHT_TOLERANCE = LR * 1e-2
"""Largest |fsdp - local| of a weight after one step (test_fsdp.py's docstring derives it)."""


def trajectories(count: int = 7, seed: int = 0) -> tuple[list[Sample], list[float]]:
    """Trajectories of different lengths (so the workers' shares and micro-batch counts differ)."""
    rng = random.Random(seed)
    samples, advantages = [], []
    for i in range(count):
        prompt, sampled = rng.randint(4, 40), rng.randint(2, 12)
        ids = [rng.randrange(10, 49000) for _ in range(prompt + sampled)]
        mask = [0] * prompt + [1] * sampled
        samples.append(Sample(f"s{i}", f"g{i // 2}", ids, mask, [-rng.uniform(0.5, 6.0) * m for m in mask],
                              [0] * len(ids), 0.0))
        advantages.append(rng.uniform(-1.0, 1.0))
    return samples, advantages


def train_config(tmp_path: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"lr": LR, "micro_batch_tokens": 96, "checkpoint_dir": tmp_path / "ckpt",
                              "device": "cpu", "lora_rank": 8, **overrides}
    return TrainConfig(**values)


def local_backend(cfg: TrainConfig, base: Path, resume: Path | None = None) -> LocalBackend:
    torch.manual_seed(cfg.seed)  # as the loop does before it builds a backend
    return LocalBackend(cfg, base, resume)


def trainable(backend: LocalBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.model.named_parameters() if v.requires_grad}


def assert_same_step(local: dict[str, Any], fsdp: dict[str, Any]) -> None:
    """The step's figures agree to a relative 1e-5 (a wrong gradient scale shows here, not in Adam's step)."""
    for key in ("grad_norm", "loss", "is_weight", "trained_tokens"):
        assert fsdp[key] == pytest.approx(local[key], rel=1e-5, abs=1e-9), key


def max_difference(expected: dict[str, torch.Tensor], actual: dict[str, Any]) -> float:
    assert set(expected) <= set(actual)  # the gathered state also names the tied head
    return max(float((actual[k].float() - v).abs().max()) for k, v in expected.items())
