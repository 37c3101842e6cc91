"""The fsdp backend on this CPU: two Ray actors, FSDP2 over gloo, against the local backend.

One step on the same batch from the same seed must give the same weights as the local backend, for
full fine-tuning and for LoRA. Tolerance: both compute in float32 and differ only in the order in
which gradients are summed (each worker sums its share, then the shares are reduced), which moves a
gradient by float32 rounding, about 1e-7 of the largest terms summed (here about 1e-10 absolute).
AdamW's first step is lr * g / (|g| + eps): for ordinary gradients it hardly moves, but where g is
itself below eps = 1e-8 (terms that cancel) the step is lr * g / eps, so an absolute error of 1e-10
moves a weight by lr * 1e-2. That is the bound asserted; a real fault (a share lost or counted twice,
a wrong normalisation) moves weights by a good fraction of lr. Adam hardly notices a gradient that is
uniformly scaled, so the gradient norm and the loss, which would show a wrong scale, are compared
too, at a relative 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tracetrain.trainer import checkpoint
from tracetrain.trainer.backend import StepBatch

ray = pytest.importorskip("ray", reason="the distributed extra (Ray) is not installed")

from tests.support.fsdp_step import (  # noqa: E402
    LR,
    WEIGHT_TOLERANCE,
    assert_same_step,
    local_backend,
    max_difference,
    train_config,
    trainable,
    trajectories,
)
from tracetrain.trainer.fsdp_backend import FSDPBackend  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray for the module: each backend then starts only its actors."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_fsdp_step_on_two_workers_equals_one_local_step(local_ray: None, tiny_model_path: Path, tmp_path: Path,
                                                            lora: bool) -> None:
    samples, advantages = trajectories()
    local = local_backend(train_config(tmp_path, lora=lora), tiny_model_path)
    before = trainable(local)
    local_figures = local.step(StepBatch(samples, advantages))
    expected = trainable(local)
    fsdp = FSDPBackend(train_config(tmp_path, lora=lora, workers=2), tiny_model_path, None)
    try:
        fsdp_figures = fsdp.step(StepBatch(samples, advantages))
        actual = fsdp.weights()
        served = dict(fsdp.served_weights(merged=lora))  # what a publish from memory sends the engine
    finally:
        fsdp.close()
    expected_served = dict(local.served_weights(merged=lora))
    assert set(served) == set(expected_served)
    print(f"max |fsdp - local| of the served weights: {max_difference(expected_served, served):.3g}")
    assert max_difference(expected_served, served) < WEIGHT_TOLERANCE
    assert fsdp_figures["micro_batches"] > 1 and len(set(fsdp_figures["worker_tokens"])) > 1
    assert_same_step(local_figures, fsdp_figures)
    moved = max(float((expected[k] - before[k]).abs().max()) for k in before)
    assert moved > 0.5 * LR, "the step changed the weights by about lr"
    difference = max_difference(expected, actual)
    print(f"max |fsdp - local| after one step ({'lora' if lora else 'full'}): {difference:.3g}")
    assert difference < WEIGHT_TOLERANCE


def test_a_worker_without_samples_keeps_step_with_the_others(local_ray: None, tiny_model_path: Path,
                                                             tmp_path: Path) -> None:
    """One sample, two workers: the second trains a borrowed sample at weight 0, and the result is the
    local step's."""
    samples, advantages = trajectories(count=1, seed=3)
    local = local_backend(train_config(tmp_path, lora=False), tiny_model_path)
    local_figures = local.step(StepBatch(samples, advantages))
    fsdp = FSDPBackend(train_config(tmp_path, lora=False, workers=2), tiny_model_path, None)
    try:
        fsdp_figures = fsdp.step(StepBatch(samples, advantages))
        assert max_difference(trainable(local), fsdp.weights()) < WEIGHT_TOLERANCE
    finally:
        fsdp.close()
    assert_same_step(local_figures, fsdp_figures)
    assert sorted(fsdp_figures["worker_tokens"]) == [0, samples[0].num_sampled]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_checkpoint_from_two_workers_resumes_on_one(local_ray: None, tiny_model_path: Path, tmp_path: Path,
                                                      lora: bool) -> None:
    """Sharded state written by 2 workers, loaded by 1 fsdp worker and by the local backend: the same
    weights, and the same next step (so the optimizer moments came along). The engine's files are
    complete, without the optimizer ever being gathered."""
    first, second = trajectories(seed=1), trajectories(seed=2)
    path = tmp_path / "v000001"
    two = FSDPBackend(train_config(tmp_path, lora=lora, workers=2), tiny_model_path, None)
    try:
        two.step(StepBatch(*first))
        path.mkdir()
        two.save(path, merged=lora)
        two.save_state(path / checkpoint.SHARDED_DIR)
        saved = two.weights()
        two.step(StepBatch(*second))
        after_two = two.weights()
    finally:
        two.close()
    engine_file = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (path / engine_file).exists() and (path / checkpoint.SHARDED_DIR).is_dir()
    if lora:
        assert (path / checkpoint.MERGED_DIR / "model.safetensors").exists()

    one = FSDPBackend(train_config(tmp_path, lora=lora, workers=1, backend="fsdp"), tiny_model_path, path)
    try:
        assert max_difference({k: v.float() for k, v in saved.items()}, one.weights()) == 0.0
        one.step(StepBatch(*second))
        assert max_difference({k: v.float() for k, v in after_two.items()}, one.weights()) < WEIGHT_TOLERANCE
    finally:
        one.close()

    local = local_backend(train_config(tmp_path, lora=lora), tiny_model_path, path)
    assert max_difference(trainable(local), saved) == 0.0
    local.step(StepBatch(*second))
    assert max_difference(trainable(local), after_two) < WEIGHT_TOLERANCE


def test_the_loop_trains_checkpoints_and_resumes_through_fsdp(local_ray: None, tiny_model_path: Path,
                                                              tmp_path: Path) -> None:
    """The learning loop is the same for both backends: claims, checkpoint, version row with each
    worker's memory; a local trainer then carries on from the fsdp checkpoint."""
    from sqlmodel import Session

    from tests.support.sessions import add_session
    from tracetrain.store.db import open_db
    from tracetrain.store.models import Policy
    from tracetrain.trainer.loop import Trainer

    db = open_db(f"sqlite:///{tmp_path / 't.db'}")
    with Session(db) as s:
        for i in range(8):
            add_session(s, f"a{i}", f"g{i // 4}", float(i % 2))
        s.commit()
    values: dict[str, Any] = {"batch_sessions": 8, "min_sessions": 1, "max_staleness": 1}
    trainer = Trainer(train_config(tmp_path, lora=False, workers=2, **values), db, tiny_model_path)
    try:
        assert trainer.step_once() and trainer.version == 1
    finally:
        trainer.close()
    written = {p.name for p in (tmp_path / "ckpt" / "v000001").iterdir()}
    assert {"model.safetensors", checkpoint.SHARDED_DIR, checkpoint.STATE_FILE} <= written
    with Session(db) as s:
        policy = s.get(Policy, ("default", 1))
        assert policy is not None and policy.metrics["workers"] == 2 and policy.metrics["samples"] == 8
        assert [m["peak_bytes"] > 0 for m in policy.metrics["memory"]] == [True, True]

    with Session(db) as s:
        for i in range(4):
            add_session(s, f"b{i}", f"h{i // 2}", float(i % 2), version=1)
        s.commit()
    again = Trainer(train_config(tmp_path, lora=False, **values), db, tiny_model_path)
    assert again.version == 1 and again.counts["steps"] == 1
    assert again.step_once() and again.version == 2


def test_activation_checkpointing_and_bfloat16_on_two_workers(local_ray: None, tiny_model_path: Path,
                                                                tmp_path: Path) -> None:
    """Recomputing activations changes nothing in float32 (same weights as the plain local step);
    bfloat16 compute over float32 master weights gives the float32 step's loss to bfloat16 precision
    (2**-8 relative per operation: a few per cent after a forward pass) and float32 weights."""
    samples, advantages = trajectories(seed=4)
    local = local_backend(train_config(tmp_path, lora=False), tiny_model_path)
    expected_figures = local.step(StepBatch(samples, advantages))
    expected = trainable(local)
    for overrides in ({"activation_checkpointing": True}, {"dtype": "bfloat16"}):
        fsdp = FSDPBackend(train_config(tmp_path, lora=False, workers=2, **overrides), tiny_model_path, None)
        try:
            figures = fsdp.step(StepBatch(samples, advantages))
            weights = fsdp.weights()
        finally:
            fsdp.close()
        assert all(w.dtype == torch.float32 for w in weights.values()), "master weights stay float32"
        if "dtype" in overrides:
            assert figures["loss"] == pytest.approx(expected_figures["loss"], rel=0.05, abs=1e-3)
        else:
            assert_same_step(expected_figures, figures)
            assert max_difference(expected, weights) < WEIGHT_TOLERANCE
