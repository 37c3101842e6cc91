"""The trainer on a CUDA GPU: bf16 precision, FSDP2 against the local backend, LoRA against its merge.

Marked `gpu`: tests/conftest.py deselects them where torch sees no CUDA device. On a lent GPU machine
they run with `python3 -m pytest --noconftest -p no:cacheprovider -q -m gpu tests/gpu` (bench/README.md,
"GPU check"): `--noconftest` because the suite's conftest imports the gateway (fastapi, uvicorn), which
the GPU image lacks; these tests need only the trainer, and build their models from a config with random
weights (no model files travel). The comparisons are bench/gpu_check.py's part 2, asserted here.

Nothing at module level imports torch, so collecting this file costs nothing where it is deselected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

LR = 1e-3
"""bench/gpu_check.py's `fsdp_vs_local` steps at this learning rate: one step moves a weight by about it."""


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's architecture with random float32 weights (drawn on the GPU)."""
    from bench.gpu_check import SMOLLM2_135M, model_dir

    return model_dir(SMOLLM2_135M, tmp_path_factory.mktemp("models"), device="cuda")


def test_bf16_logprobs_on_the_gpu_match_float32_on_the_cpu(smollm2_shape: Path, tmp_path: Path) -> None:
    """The trainer's logprobs (SampledLogits + sequence_logprobs under the local backend's autocast) in
    bf16 on the GPU, against float32 on the CPU, on 8 × 512 random tokens.

    Tolerance: max 0.1 nats, mean 0.02 nats per sampled token. bf16 keeps 8 significant bits, so each
    matmul input is rounded by up to 2^-9 relative; over 30 layers the roundings add up like a random
    walk. With these random weights (near-uniform predictions) the CPU's own bf16 autocast lands at a
    few hundredths at most, so the bound leaves room for the GPU's different kernels while a real fault
    (a shifted target, a lost mask, a float16 overflow) moves logprobs by whole nats. float32 on the GPU
    must match float32 on the CPU to 1e-3 nats (summation order only: TF32 is off by default)."""
    from bench.gpu_check import SMOLLM2_135M, logprob_precision, random_batch

    samples, _ = random_batch(8, 512, SMOLLM2_135M.vocab, seed=1)
    figures = logprob_precision(smollm2_shape, samples, device="cuda", work=tmp_path)
    print(figures)
    assert figures["positions"] == 8 * 256
    assert figures["bf16_vs_cpu_fp32"]["max"] < 0.1
    assert figures["bf16_vs_cpu_fp32"]["mean"] < 0.02
    assert figures["bf16_vs_cpu_fp32"]["max"] > 0, "bf16 autocast did not take effect"
    assert figures["fp32_vs_cpu_fp32"]["max"] < 1e-3


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_fsdp2_step_over_nccl_equals_a_local_step(smollm2_shape: Path, tmp_path: Path, lora: bool) -> None:
    """One FSDP2 step with world size 1 over NCCL (bench/gpu_check.py's `fsdp_step`: the worker's own
    sharding, step and gathering, in this process) against one local-backend step, float32, same seed.

    Tolerance as tests/integration/test_fsdp.py derives it: weights within lr × 1e-2, loss and gradient
    norm within a relative 1e-5. With one rank the reduce-scatter only copies, so what differs is the
    optimizer (FSDP's for-each AdamW against the local backend's fused one): rounding, far inside the
    bound. With one GPU there is no second rank; the multi-rank case is the CPU test's."""
    from bench.gpu_check import SMOLLM2_135M, fsdp_vs_local, random_batch

    samples, advantages = random_batch(8, 256, SMOLLM2_135M.vocab, seed=2)
    figures: dict[str, Any] = fsdp_vs_local(smollm2_shape, device="cuda", dtype="float32", lora=lora,
                                            samples=samples, advantages=advantages, micro_batch_tokens=512,
                                            work=tmp_path)
    print(figures)
    assert figures["max_abs_weight_moved"] > 0.5 * LR, "the step changed the weights by about lr"
    assert figures["max_abs_weight_difference"] < LR * 1e-2
    assert figures["loss_relative_difference"] < 1e-5
    assert figures["grad_norm_relative_difference"] < 1e-5


def test_a_trained_lora_adapter_matches_its_merged_weights(smollm2_shape: Path, tmp_path: Path) -> None:
    """A float32 LoRA step saved as the trainer saves it; the adapter applied with PEFT in transformers on
    the GPU and the `merged/` weights give the same logprobs.

    Tolerance 1e-3 nats: the merge computes W + s·B·A once in float32 where PEFT adds s·(x·Aᵀ)·Bᵀ on each
    call, a difference of float32 rounding. The adapter itself must move logprobs by more than 1e-2 (the
    step is taken at lr 1e-2), or the comparison would say nothing."""
    from bench.gpu_check import SMOLLM2_135M, lora_vs_merged, random_batch

    samples, advantages = random_batch(8, 256, SMOLLM2_135M.vocab, seed=3)
    figures = lora_vs_merged(smollm2_shape, device="cuda", samples=samples, advantages=advantages,
                             micro_batch_tokens=512, work=tmp_path)
    print(figures)
    assert figures["max_abs_adapter_vs_base"] > 1e-2
    assert figures["max_abs_adapter_vs_merged"] < 1e-3


def test_a_bf16_step_on_the_gpu_keeps_float32_master_weights(smollm2_shape: Path, tmp_path: Path) -> None:
    """The local backend on cuda with `dtype: bfloat16`: the step runs under autocast, its figures are
    finite, the weights it updates stay float32 on the GPU, and the peak memory it reports is the GPU's."""
    import math

    import torch

    from bench.gpu_check import SMOLLM2_135M, random_batch, train_config
    from tracetrain.trainer.backend import StepBatch
    from tracetrain.trainer.local_backend import LocalBackend

    cfg = train_config(tmp_path, device="cuda", dtype="bfloat16", lora=False, lr=1e-5, micro_batch_tokens=2048)
    torch.manual_seed(cfg.seed)
    backend = LocalBackend(cfg, smollm2_shape, None)
    figures = backend.step(StepBatch(*random_batch(8, 512, SMOLLM2_135M.vocab, seed=4)))
    assert math.isfinite(figures["loss"]) and math.isfinite(figures["grad_norm"]) and figures["grad_norm"] > 0
    assert all(p.dtype == torch.float32 and p.is_cuda for p in backend.model.parameters())
    assert 0 < figures["memory"][0]["peak_bytes"] <= torch.cuda.max_memory_allocated()
