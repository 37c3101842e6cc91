"""`train.torch_compile`: the compiled decoder layers give the step the plain layers give (the plain
model is the reference), and what the trainer saves keeps the plain model's parameter names."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.setup_steps import TORCH_MISSING
from tracetrain.config import TrainConfig
from tracetrain.trainer.backend import StepBatch
from tracetrain.trainer.data import Sample

torch = pytest.importorskip("torch", reason=TORCH_MISSING)

from tracetrain.trainer.local_backend import LocalBackend  # noqa: E402


def _batch() -> StepBatch:
    """Two lengths, so the compiled layers meet more than one shape."""
    rng = random.Random(1)
    samples, advantages = [], []
    for i, length in enumerate((24, 24, 40, 40)):
        ids = [rng.randrange(10, 49000) for _ in range(length)]
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        samples.append(Sample(f"s{i}", f"g{i // 2}", ids, mask, [-2.0 * m for m in mask], [0] * length, 0.0))
        advantages.append(1.0 if i % 2 else -1.0)
    return StepBatch(samples, advantages)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_compiled_layers_take_the_same_step_as_plain_ones(tiny_model_path: Path, tmp_path: Path, lora: bool) -> None:
    batch = _batch()
    runs = {}
    for compiled in (False, True):
        cfg = TrainConfig(lora=lora, lr=1e-2, micro_batch_tokens=64, torch_compile=compiled,
                          checkpoint_dir=tmp_path / f"ckpt-{compiled}")
        torch.manual_seed(0)
        backend = LocalBackend(cfg, tiny_model_path, None)
        before = {name: p.detach().clone() for name, p in backend.model.named_parameters() if p.requires_grad}
        figures = [backend.step(batch) for _ in range(2)]
        weights = {name: p.detach().clone() for name, p in backend.model.named_parameters() if p.requires_grad}
        logprobs = backend.logprobs(batch.samples[0].input_ids)
        runs[compiled] = (figures, weights, logprobs, list(backend.model.state_dict()))
        stepped = max(float((weights[name] - w).abs().max()) for name, w in before.items())
        backend.close()
    (plain, plain_w, plain_lp, plain_keys), (comp, comp_w, comp_lp, comp_keys) = runs[False], runs[True]
    # float32 on the CPU: the fused kernels reorder additions, so equal up to rounding, far below what
    # the two steps at lr 1e-2 moved
    for a, b in zip(plain, comp, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    moved = max(float((w - b).abs().max()) for w, b in zip(plain_w.values(), comp_w.values(), strict=True))
    assert moved < 1e-4 < stepped / 10
    assert max(abs(x - y) for x, y in zip(plain_lp, comp_lp, strict=True)) < 1e-4
    assert comp_keys == plain_keys  # checkpoints load into a plain model
