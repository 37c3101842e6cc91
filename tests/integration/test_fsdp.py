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

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tracetrain.config import TrainConfig
from tracetrain.trainer import checkpoint
from tracetrain.trainer.backend import StepBatch
from tracetrain.trainer.data import Sample

ray = pytest.importorskip("ray", reason="the distributed extra (Ray) is not installed")

from tracetrain.trainer.fsdp_backend import FSDPBackend  # noqa: E402
from tracetrain.trainer.local_backend import LocalBackend  # noqa: E402


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray for the module: each backend then starts only its actors."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _samples(count: int = 7, seed: int = 0) -> tuple[list[Sample], list[float]]:
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


def _config(tmp_path: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"lr": 1e-3, "micro_batch_tokens": 96, "checkpoint_dir": tmp_path / "ckpt",
                              "device": "cpu", "lora_rank": 8, **overrides}
    return TrainConfig(**values)


def _local(cfg: TrainConfig, base: Path, resume: Path | None = None) -> LocalBackend:
    torch.manual_seed(cfg.seed)  # as the loop does before it builds a backend
    return LocalBackend(cfg, base, resume)


def _trainable(backend: LocalBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.model.named_parameters() if v.requires_grad}


def _assert_same_step(local: dict[str, Any], fsdp: dict[str, Any]) -> None:
    for key in ("grad_norm", "loss", "is_weight", "trained_tokens"):
        assert fsdp[key] == pytest.approx(local[key], rel=1e-5, abs=1e-9), key


def _max_difference(expected: dict[str, torch.Tensor], actual: dict[str, Any]) -> float:
    assert set(expected) <= set(actual)  # the gathered state also names the tied head
    return max(float((actual[k].float() - v).abs().max()) for k, v in expected.items())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_fsdp_step_on_two_workers_equals_one_local_step(local_ray: None, tiny_model_path: Path, tmp_path: Path,
                                                            lora: bool) -> None:
    samples, advantages = _samples()
    local = _local(_config(tmp_path, lora=lora), tiny_model_path)
    before = _trainable(local)
    local_figures = local.step(StepBatch(samples, advantages))
    expected = _trainable(local)
    fsdp = FSDPBackend(_config(tmp_path, lora=lora, workers=2), tiny_model_path, None)
    try:
        fsdp_figures = fsdp.step(StepBatch(samples, advantages))
        actual = fsdp.weights()
    finally:
        fsdp.close()
    assert fsdp_figures["micro_batches"] > 1 and len(set(fsdp_figures["worker_tokens"])) > 1
    _assert_same_step(local_figures, fsdp_figures)
    moved = max(float((expected[k] - before[k]).abs().max()) for k in before)
    assert moved > 0.5 * 1e-3, "the step changed the weights by about lr"
    difference = _max_difference(expected, actual)
    print(f"max |fsdp - local| after one step ({'lora' if lora else 'full'}): {difference:.3g}")
    assert difference < 1e-3 * 1e-2


def test_a_worker_without_samples_keeps_step_with_the_others(local_ray: None, tiny_model_path: Path,
                                                             tmp_path: Path) -> None:
    """One sample, two workers: the second trains a borrowed sample at weight 0, and the result is the
    local step's."""
    samples, advantages = _samples(count=1, seed=3)
    local = _local(_config(tmp_path, lora=False), tiny_model_path)
    local_figures = local.step(StepBatch(samples, advantages))
    fsdp = FSDPBackend(_config(tmp_path, lora=False, workers=2), tiny_model_path, None)
    try:
        fsdp_figures = fsdp.step(StepBatch(samples, advantages))
        assert _max_difference(_trainable(local), fsdp.weights()) < 1e-3 * 1e-2
    finally:
        fsdp.close()
    _assert_same_step(local_figures, fsdp_figures)
    assert sorted(fsdp_figures["worker_tokens"]) == [0, samples[0].num_sampled]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_checkpoint_from_two_workers_resumes_on_one(local_ray: None, tiny_model_path: Path, tmp_path: Path,
                                                      lora: bool) -> None:
    """Sharded state written by 2 workers, loaded by 1 fsdp worker and by the local backend: the same
    weights, and the same next step (so the optimizer moments came along). The engine's files are
    complete, without the optimizer ever being gathered."""
    first, second = _samples(seed=1), _samples(seed=2)
    path = tmp_path / "v000001"
    two = FSDPBackend(_config(tmp_path, lora=lora, workers=2), tiny_model_path, None)
    try:
        two.step(StepBatch(*first))
        path.mkdir()
        two.save(path, merged=lora)
        saved = two.weights()
        two.step(StepBatch(*second))
        after_two = two.weights()
    finally:
        two.close()
    engine_file = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (path / engine_file).exists() and (path / checkpoint.SHARDED_DIR).is_dir()
    if lora:
        assert (path / checkpoint.MERGED_DIR / "model.safetensors").exists()

    one = FSDPBackend(_config(tmp_path, lora=lora, workers=1, backend="fsdp"), tiny_model_path, path)
    try:
        assert _max_difference({k: v.float() for k, v in saved.items()}, one.weights()) == 0.0
        one.step(StepBatch(*second))
        assert _max_difference({k: v.float() for k, v in after_two.items()}, one.weights()) < 1e-3 * 1e-2
    finally:
        one.close()

    local = _local(_config(tmp_path, lora=lora), tiny_model_path, path)
    assert _max_difference(_trainable(local), saved) == 0.0
    local.step(StepBatch(*second))
    assert _max_difference(_trainable(local), after_two) < 1e-3 * 1e-2


def test_the_loop_trains_checkpoints_and_resumes_through_fsdp(local_ray: None, tiny_model_path: Path,
                                                              tmp_path: Path) -> None:
    """The learning loop is the same for both backends: claims, checkpoint, version row with each
    worker's memory; a local trainer then carries on from the fsdp checkpoint."""
    from sqlmodel import Session

    from tests.support.sessions import add_session
    from tracetrain.store.db import make_engine
    from tracetrain.store.models import Policy
    from tracetrain.trainer.loop import Trainer

    db = make_engine(f"sqlite:///{tmp_path / 't.db'}")
    with Session(db) as s:
        for i in range(8):
            add_session(s, f"a{i}", f"g{i // 4}", float(i % 2))
        s.commit()
    values: dict[str, Any] = {"batch_sessions": 8, "min_sessions": 1, "max_staleness": 1}
    trainer = Trainer(_config(tmp_path, lora=False, workers=2, **values), db, tiny_model_path)
    try:
        assert trainer.step_once() and trainer.version == 1
    finally:
        trainer.close()
    written = {p.name for p in (tmp_path / "ckpt" / "v000001").iterdir()}
    assert {"model.safetensors", checkpoint.SHARDED_DIR, checkpoint.STATE_FILE} <= written
    with Session(db) as s:
        policy = s.get(Policy, 1)
        assert policy is not None and policy.metrics["workers"] == 2 and policy.metrics["samples"] == 8
        assert [m["peak_bytes"] > 0 for m in policy.metrics["memory"]] == [True, True]

    with Session(db) as s:
        for i in range(4):
            add_session(s, f"b{i}", f"h{i // 2}", float(i % 2), version=1)
        s.commit()
    again = Trainer(_config(tmp_path, lora=False, **values), db, tiny_model_path)
    assert again.version == 1 and again.counts["steps"] == 1
    assert again.step_once() and again.version == 2


def test_activation_checkpointing_and_bfloat16_on_two_workers(local_ray: None, tiny_model_path: Path,
                                                                tmp_path: Path) -> None:
    """Recomputing activations changes nothing in float32 (same weights as the plain local step);
    bfloat16 compute over float32 master weights gives the float32 step's loss to bfloat16 precision
    (2**-8 relative per operation: a few per cent after a forward pass) and float32 weights."""
    samples, advantages = _samples(seed=4)
    local = _local(_config(tmp_path, lora=False), tiny_model_path)
    expected_figures = local.step(StepBatch(samples, advantages))
    expected = _trainable(local)
    for overrides in ({"activation_checkpointing": True}, {"dtype": "bfloat16"}):
        fsdp = FSDPBackend(_config(tmp_path, lora=False, workers=2, **overrides), tiny_model_path, None)
        try:
            figures = fsdp.step(StepBatch(samples, advantages))
            weights = fsdp.weights()
        finally:
            fsdp.close()
        assert all(w.dtype == torch.float32 for w in weights.values()), "master weights stay float32"
        if "dtype" in overrides:
            assert figures["loss"] == pytest.approx(expected_figures["loss"], rel=0.05, abs=1e-3)
        else:
            _assert_same_step(expected_figures, figures)
            assert _max_difference(expected, weights) < 1e-3 * 1e-2
