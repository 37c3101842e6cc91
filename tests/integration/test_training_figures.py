"""Figures a training step records for the console's policies page: the clip fraction (the share of
sampled tokens whose importance ratio the policy loss clipped) and the advantage spread."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from tests.support.setup_steps import TORCH_MISSING
from tracetrain.config import TrainConfig
from tracetrain.trainer.backend import StepBatch
from tracetrain.trainer.data import Sample

pytest.importorskip("torch", reason=TORCH_MISSING)

from tracetrain.trainer.local_backend import LocalBackend  # noqa: E402


def _batch(count: int = 6) -> StepBatch:
    rng = random.Random(0)
    samples, advantages = [], []
    for i in range(count):
        prompt, sampled = rng.randint(4, 20), rng.randint(4, 12)
        ids = [rng.randrange(10, 49000) for _ in range(prompt + sampled)]
        mask = [0] * prompt + [1] * sampled
        samples.append(Sample(f"s{i}", f"g{i // 2}", ids, mask, [-2.0 * m for m in mask], [0] * len(ids), 0.0))
        advantages.append(1.0 if i % 2 else -1.0)
    return StepBatch(samples, advantages)


def test_the_clip_fraction_comes_from_the_policy_loss(tiny_model_path: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(lora=False, lr=1e-3, clip_ratio=0.2, tis_cap=None, checkpoint_dir=tmp_path / "ckpt")
    backend = LocalBackend(cfg, tiny_model_path, None)
    try:
        figures = backend.step(_batch())
    finally:
        backend.close()
    # One optimizer step per batch: the ratio to the policy that just scored the tokens is 1 everywhere,
    # so PPO clips nothing (the behaviour policy's distance is the importance weights' business).
    assert figures["clip_fraction"] == 0.0 and figures["loss"] != 0.0


def test_a_version_records_its_advantage_spread(tiny_model_path: Path, tmp_path: Path) -> None:
    from sqlmodel import Session

    from tests.support.sessions import add_session
    from tracetrain.store.db import open_db
    from tracetrain.store.models import Policy
    from tracetrain.trainer.loop import Trainer

    db = open_db(f"sqlite:///{tmp_path / 'figures.db'}")
    with Session(db) as s:
        for i, reward in enumerate([1.0, 0.0, 1.0, 1.0]):
            add_session(s, f"s{i}", "g", reward)
        s.commit()
    trainer = Trainer(TrainConfig(lora=False, lr=1e-3, advantage="rloo", batch_sessions=4, min_sessions=1,
                                  checkpoint_dir=tmp_path / "ckpt"), db, tiny_model_path)
    try:
        assert trainer.step_once()
    finally:
        trainer.close()
    with Session(db) as s:
        figures = s.get(Policy, ("default", 1)).metrics  # type: ignore[union-attr]
    # RLOO: each reward against the mean of the other three: 1 - 2/3 (three times) and 0 - 1
    expected = statistics.pstdev([1 / 3, -1.0, 1 / 3, 1 / 3])
    assert figures["advantage_std"] == pytest.approx(expected, rel=1e-5)
    assert figures["clip_fraction"] == 0.0
