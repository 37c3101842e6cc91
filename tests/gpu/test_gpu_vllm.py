"""vLLM on a CUDA GPU: versions published into it and proven by the probe, and `serve --train` with vLLM
asleep during each sync step on the GPU it shares with the trainer.

Marked `gpu`, like tests/gpu/test_gpu_trainer.py, and run on a lent GPU machine once vLLM is carried
there (`python -m bench.gpu_carry` prints the calls; its last one runs this file). The comparisons are
bench/gpu_check.py's part 3, asserted here, on SmolLM2-135M's architecture with random weights (no model
files travel).

Tolerance of the probe (engines/probe.py, `TOLERANCE`): mean |logprob difference| at most 5e-2 nats
between the trainer's bf16 scores (autocast over float32 weights, tests/gpu/test_gpu_trainer.py bounds
those against float32 at 2e-2 mean) and vLLM serving the same weights in bf16; a wrong adapter moves
every token by far more (it must be refused).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

MEMORY_SHARE = 0.3


def test_lora_and_full_publishes_are_proven_and_a_wrong_adapter_is_refused(tmp_path: Path) -> None:
    """LoRA loaded into a server started with --enable-lora, full weights reloaded into one without it, from
    disk and then by CUDA IPC from a model on the GPU; each proven by the probe against the trainer's bf16
    logprobs; then a copy of the adapter with its
    LoRA B weights redrawn, carrying the right adapter's probe, is refused; the servers still answer."""
    from bench.gpu_check import SMOLLM2_135M, publish_latency

    figures = publish_latency(SMOLLM2_135M, python=sys.executable, device="cuda", dtype="bfloat16", work=tmp_path,
                              memory_share=MEMORY_SHARE, repeats=1)
    print(figures["summary"])
    probes = figures["probes"]
    assert probes["lora"]["ok"] and probes["full"]["ok"] and probes["full from memory"]["ok"], probes
    assert figures["memory_routes"] == ["memory"]  # CUDA IPC, not the fallback to disk
    assert not probes["wrong lora (caught?)"]["ok"], probes
    assert probes["lora"]["tolerance"] == 5e-2
    assert figures["answers_after"]


def test_serve_train_on_one_gpu_sleeps_trains_wakes_and_publishes(tmp_path: Path) -> None:
    """`serve --train` with engine.gpus = train.gpus = [0], a 0.3 memory share and sleep mode: agents call
    for 40 s while the trainer steps in sync mode. vLLM falls asleep for each step, wakes for the publish
    and stays awake under its probe; no call fails and trained versions are served."""
    from bench.gpu_check import LEARN_SPEC, serve_train_end_to_end

    figures = serve_train_end_to_end(LEARN_SPEC, python=sys.executable, device="cuda", work=tmp_path,
                                     memory_share=MEMORY_SHARE, timeout_s=180, learn_s=40)
    print(figures["summary"])
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "vLLM asleep while the trainer steps" in log and "vLLM awake again" in log
    assert figures["failed_calls"] == 0, figures["errors"]
    assert figures["versions_served"] >= 1
