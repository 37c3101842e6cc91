"""GPU check (issue 29): the trainer's real step on a lent GPU machine, as one prepared command.

Parts, in priority order, so that a short lease still brings back part 1:

1. Training-step throughput and MFU of the project's own step: `LocalBackend.step` (trainer/step.py's
   RL step with verl's PPO loss, bf16 autocast over float32 master weights, fused AdamW) on
   SmolLM2-135M's architecture and on a 1.24B Llama (Llama-3.2-1B's shape), random weights, full
   fine-tuning and LoRA.
2. Equivalence and precision: bf16 trainer logprobs on the GPU against float32 on the CPU (the
   tolerance basis for the later vLLM probe), one FSDP2 step over NCCL (world size 1) against one local
   step, a LoRA adapter applied in transformers against its merged weights.
3. vLLM on the GPU, carried in chunks over several device calls (bench/gpu_carry.py): publish latency
   (LoRA load, full reload) with the publish probe proving each version and refusing a wrong adapter, and
   `tracetrain serve --train` colocated on one GPU (vLLM asleep during each sync step) with agents
   learning for two minutes. Skipped with the reason when vLLM cannot be imported.

    python -m bench.gpu_check --dry-run --out /tmp/gc      # on this CPU: tiny sizes, prints the commands
    python -m bench.gpu_check --wheels .whl                # fetches the wheels parts 1-2 need (py3.12)
    python -m bench.gpu_check --part 1,2 --out "$OUT"      # on the GPU machine (see bench/README.md)
    python -m bench.gpu_check --collect DIR                # returned files -> bench/results/gpu_check.*

Every part writes `OUT/gpu_check_partN.json` (rewritten after each measurement, so a command cut short
still returns what it finished) and `OUT/gpu_check.md` with a table per part found in OUT.

MFU (model FLOPs utilisation) counts the FLOPs the step's model math needs, not what the kernels did
(activation recomputation is not counted), divided by step time and the GPU's dense bf16 peak:

    full:  6·N_body·T + 6·V·d·S + 6·L·d·ΣTᵢ²
    LoRA:  4·N_body·T + 4·V·d·S + 6·N_lora·T + 6·L·d·ΣTᵢ²

N_body: parameters of the decoder layers and final norm (the embedding lookup is no matmul); T: tokens
in the step; S: positions whose logits the step computes (the project's `SampledLogits` runs the
vocabulary projection only where the next token was sampled); V·d: the head; L·d·ΣTᵢ²: causal
attention (QKᵀ and AV over the lower triangle, 2·Tᵢ²·d per layer forward, twice that backward). LoRA's
frozen weights need no weight gradients (4 instead of 6 per parameter). `mfu_6nd` is the common
6·N_total·T shorthand, reported beside it for comparison; it counts the head on every token.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.metadata
import json
import math
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    RunStart,
    command_output,
    git_sha,
    package_version,
    run_started,
    utc_text,
    write_results,
)
from bench.common import provenance as common_provenance
from bench.gpu_carry import PIP_DOWNLOAD, drop_from_wheel

if TYPE_CHECKING:
    from tracetrain.config import TrainConfig
    from tracetrain.trainer.data import Sample

SCHEMA = "tracetrain.gpu_check/1"
PARTS = (1, 2, 3)
PART_TITLES = {
    1: "Training-step throughput and MFU (the project's LocalBackend step)",
    2: "Equivalence and precision (bf16 vs float32 logprobs, FSDP2 vs local step, LoRA adapter vs merged)",
    3: "vLLM on the GPU: publish latency, the publish probe, serve --train with agents learning",
}
PART_BUDGET_S = {1: 420.0, 2: 150.0, 3: 420.0}
"""Each part's own time budget on the GPU machine (model builds included): a measurement whose budget
estimate no longer fits is skipped and recorded as such. Parts 1 and 2 together, with the imports, the
wheel install and the GPU tests, fit one device call of DEVICE_TIMEOUT_S."""
DEVICE_TIMEOUT_S = 560
GPU_TESTS_TIMEOUT_S = 100
WORK_DIR = Path(tempfile.gettempdir()) / "tracetrain-gpu-check"
"""Model directories and checkpoints on the machine that runs a part (never returned: too large)."""
WHEEL_INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                 "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1")
CARRY_LIMIT_BYTES = 64 * 2**20
PROVENANCE_KEYS = ("nvidia_smi", "device_name", "versions", "git_sha", "cpu_model", "cpu_count", "load_average",
                   "python", "hostname", "started_utc", "ended_utc")

_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[gpu_check +{time.perf_counter() - _STARTED:6.1f}s] {message}", flush=True)


# --- the GPU's peak --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    match: str
    """A substring of `torch.cuda.get_device_name()`; the first entry that matches wins."""
    tflops: float
    source: str


PEAKS = (
    Peak("H100 NVL", 835.5, "NVIDIA H100 NVL datasheet: BF16 Tensor Core 1,671 TFLOPS with sparsity; dense is half"),
    Peak("H100 PCIe", 756.5, "NVIDIA H100 PCIe datasheet: BF16 Tensor Core 1,513 TFLOPS with sparsity; dense is half"),
    Peak("GH200", 989.0, "NVIDIA GH200 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity; dense is half"),
    Peak("H100", 989.0, "NVIDIA H100 SXM5 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity; dense is half"),
    Peak("H200 NVL", 835.5, "NVIDIA H200 NVL datasheet: BF16 Tensor Core 1,671 TFLOPS with sparsity; dense is half"),
    Peak("H200", 989.0, "NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity; dense is half"),
    Peak("A100", 312.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS dense (624 with sparsity)"),
)


def peak_for(device_name: str | None) -> Peak | None:
    if not device_name:
        return None
    return next((p for p in PEAKS if p.match in device_name), None)


# --- models ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    about: str

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self, initializer_range: float = 0.02) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate,
                           vocab_size=self.vocab, tie_word_embeddings=True, max_position_embeddings=8192,
                           rms_norm_eps=1e-5, initializer_range=initializer_range, bos_token_id=1, eos_token_id=2)


SMOLLM2_135M = ModelSpec("smollm2-135m", 576, 30, 9, 3, 1536, 49152,
                         "SmolLM2-135M's architecture (tied embeddings), random weights")
LLAMA_1B = ModelSpec("llama-1b", 2048, 16, 32, 8, 8192, 128256,
                     "Llama-3.2-1B's shape (tied embeddings, vocab 128256), random weights")
TINY = ModelSpec("tiny", 128, 2, 2, 1, 256, 1024, "a tiny Llama for the dry run, random weights")
"""Head size 64: vLLM's CPU attention kernels refuse small ones (16), and the dry run may serve it."""


def model_dir(spec: ModelSpec, root: Path, *, device: str, save_dtype: str = "float32", seed: int = 0,
              initializer_range: float = 0.02, tokenizer: bool = False) -> Path:
    """A Hugging Face directory with `spec`'s config and random weights (built once per root). Weights
    are drawn on `device` (fast on a GPU) and saved in `save_dtype`: bfloat16 halves the write and read
    of a throughput run's model, whose values do not matter; precision checks keep float32, so that
    autocast's rounding of the weights is part of what they measure."""
    import torch
    from transformers import LlamaForCausalLM

    path = root / f"{spec.name}-{save_dtype}-r{initializer_range}-s{seed}"
    if not (path / "config.json").exists():
        started = time.perf_counter()
        torch.manual_seed(seed)
        with torch.device(device):
            model: Any = LlamaForCausalLM(spec.config(initializer_range))
        model = model.to(dtype=getattr(torch, save_dtype), device="cpu")
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        tmp.rename(path)
        log(f"built {spec.name} ({save_dtype}) in {time.perf_counter() - started:.1f}s at {path}")
    if tokenizer and not (path / "tokenizer.json").exists():
        write_word_tokenizer(path, spec.vocab)
    return path


def write_word_tokenizer(path: Path, vocab: int) -> None:
    """A tokenizer for random-weight models that vLLM and the gateway can load (no hub, nothing to carry):
    one word `t<i>` per id, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, as the model's config names them
    words = {token: i for i, token in enumerate(specials)} | {f"t{i}": i for i in range(len(specials), vocab)}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens(specials)  # already in the vocabulary: marked special, ids unchanged
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def parameter_counts(model: Any) -> dict[str, int]:
    """Exact counts from the built model (a PEFT model counts its base's weights and its adapters apart)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    named = dict(base.named_parameters())  # a tied head is listed once
    embedding = base.get_input_embeddings().weight
    head = base.get_output_embeddings().weight
    total = sum(p.numel() for n, p in named.items() if "lora_" not in n)
    untied_head = 0 if head is embedding else head.numel()
    return {"total": total, "embedding": embedding.numel(), "untied_head": untied_head,
            "body": total - embedding.numel() - untied_head,
            "lora": sum(p.numel() for n, p in named.items() if "lora_" in n),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def step_flops(spec: ModelSpec, counts: dict[str, int], samples: list[Sample], *, lora: bool) -> dict[str, float]:
    """Model FLOPs of one step on `samples` (the module docstring gives the formula)."""
    tokens = sum(len(s.input_ids) for s in samples)
    logit_rows = sum(sum(s.loss_mask[1:]) for s in samples)
    squares = sum(len(s.input_ids) ** 2 for s in samples)
    passes = 4.0 if lora else 6.0
    dense = passes * counts["body"] * tokens
    head = passes * spec.vocab * spec.hidden * logit_rows
    adapters = 6.0 * counts["lora"] * tokens
    attention = 6.0 * spec.layers * spec.heads * spec.head_dim * squares
    return {"tokens": tokens, "logit_rows": logit_rows, "dense": dense, "head": head, "adapters": adapters,
            "attention": attention, "total": dense + head + adapters + attention,
            "six_nd": 6.0 * counts["total"] * tokens}


# --- batches ---------------------------------------------------------------------------------------------


def random_batch(count: int, seq_len: int, vocab: int, *, sampled_fraction: float = 0.5, seed: int = 0
                 ) -> tuple[list[Sample], list[float]]:
    """Trajectories of random tokens, the last `sampled_fraction` of each sampled. Behaviour logprobs are
    log(1/vocab), what a random-weight model predicts, so importance weights stay near 1."""
    from tracetrain.trainer.data import Sample

    rng = random.Random(seed)
    sampled = max(1, int(seq_len * sampled_fraction))
    behaviour = -math.log(vocab)
    samples, advantages = [], []
    for i in range(count):
        ids = [rng.randrange(3, vocab) for _ in range(seq_len)]
        mask = [0] * (seq_len - sampled) + [1] * sampled
        samples.append(Sample(f"s{i}", f"g{i}", ids, mask, [behaviour * m for m in mask], [0] * seq_len, 0.0))
        advantages.append(rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.0))
    return samples, advantages


def pattern_batch(count: int, seq_len: int, vocab: int, *, seed: int, prompt: int = 8) -> list[Sample]:
    """Arithmetic progressions of token ids (stride 1 to 4, read from the context): something a model
    learns in a few dozen steps, so that it predicts with confidence, as trained models do."""
    from tracetrain.trainer.data import Sample

    rng = random.Random(seed)
    span = min(vocab - 3, 512)
    samples = []
    for i in range(count):
        start, stride = rng.randrange(span), rng.randint(1, 4)
        ids = [3 + (start + stride * t) % span for t in range(seq_len)]
        mask = [0] * prompt + [1] * (seq_len - prompt)
        samples.append(Sample(f"p{seed}-{i}", f"p{seed}-{i}", ids, mask, [0.0] * seq_len, [0] * seq_len, 1.0))
    return samples


def train_config(work: Path, **values: Any) -> TrainConfig:
    from tracetrain.config import TrainConfig

    return TrainConfig(**{"checkpoint_dir": work / "ckpt", **values})


# --- provenance, results, markdown ---------------------------------------------------------------------


def utc_now() -> str:
    return utc_text(datetime.now(UTC))


GPU_CHECK_PACKAGES = ("verl", "ray", "tensordict", "safetensors", "numpy")
"""Versions recorded beside bench.common's PROVENANCE_PACKAGES: what the trainer's step runs on here."""


def provenance(sha: str, started: RunStart) -> dict[str, Any]:
    """bench.common's provenance with the trainer's other libraries and, once a part has imported torch,
    the CUDA device torch sees."""
    info = common_provenance(started, sha=sha)
    info["versions"].update({name: package_version(name) for name in GPU_CHECK_PACKAGES})
    info["device_name"] = None
    if "torch" in sys.modules:  # set once a part has imported torch; the lightweight actions never do
        import torch

        info["versions"]["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["device_name"] = torch.cuda.get_device_name()
            info["device_count"] = torch.cuda.device_count()
            info["capability"] = list(torch.cuda.get_device_capability())
            info["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    return info


@dataclass
class Part:
    """One part's record, written to `out/gpu_check_partN.json` after every measurement."""

    number: int
    out: Path
    dry_run: bool
    sha: str
    budget_s: float
    settings: dict[str, Any] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    status: str = "running"
    started: float = field(default_factory=time.perf_counter)
    started_run: RunStart = field(default_factory=run_started)

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def path(self) -> Path:
        return self.out / f"gpu_check_part{self.number}.json"

    def record(self) -> dict[str, Any]:
        info = provenance(self.sha, self.started_run)
        peak = peak_for(info.get("device_name"))
        return {"schema": SCHEMA, "part": self.number, "title": PART_TITLES[self.number], "dry_run": self.dry_run,
                "status": self.status, "elapsed_s": round(time.perf_counter() - self.started, 1),
                "budget_s": self.budget_s, "provenance": info,
                "peak": {"bf16_dense_tflops": peak.tflops, "source": peak.source, "matched": peak.match}
                if peak else None,
                "settings": self.settings, "results": self.results, "notes": self.notes,
                "device_command": device_command((self.number,), self.sha)}

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.path().write_text(json.dumps(self.record(), indent=2, default=str) + "\n")
        write_markdown(load_parts(self.out), self.out / "gpu_check.md")

    def measure(self, name: str, estimate_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one measurement unless its budget estimate no longer fits; record errors (out of memory
        included) as results rather than end the part, and free the GPU's memory after each."""
        if self.left_s() < estimate_s:
            self.results.append({"name": name, "status": "skipped",
                                 "reason": f"time budget: {self.left_s():.0f}s left of {self.budget_s:.0f}s, "
                                           f"estimate {estimate_s:.0f}s"})
            log(f"part {self.number} {name}: skipped (time budget)")
            self.save()
            return None
        log(f"part {self.number} {name}: start ({self.left_s():.0f}s of budget left)")
        started = time.perf_counter()
        try:
            result = {"name": name, "status": "ok", **fn()}
        except Exception as exc:  # noqa: BLE001 - a failed measurement is a result; the next one still runs
            kind = "out of memory" if "out of memory" in str(exc).lower() else type(exc).__name__
            trace = traceback.format_exc()
            # the whole traceback goes to the log; the record keeps its end, which names the failing line
            print(trace, flush=True)
            result = {"name": name, "status": "error", "error": f"{kind}: {str(exc)[:600]}",
                      "traceback": trace[-2000:]}
            log(f"part {self.number} {name}: {result['error']}")
        result["seconds"] = round(time.perf_counter() - started, 1)
        if result["status"] == "ok":
            log(f"part {self.number} {name}: ok in {result['seconds']}s" +
                (f": {result['summary']}" if "summary" in result else ""))
        self.results.append(result)
        free_memory()
        self.save()
        return result

    def finish(self) -> None:
        statuses = {r["status"] for r in self.results}
        if self.status == "running":
            self.status = ("ok" if statuses <= {"ok"} else "partial" if "ok" in statuses
                           else "skipped" if statuses == {"skipped"} else "failed")
        self.save()
        log(f"part {self.number}: {self.status}, {time.perf_counter() - self.started:.0f}s, wrote {self.path()}")


def free_memory() -> None:
    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def load_parts(directory: Path) -> list[dict[str, Any]]:
    parts = []
    for path in sorted(directory.glob("gpu_check_part*.json")):
        with contextlib.suppress(ValueError, OSError):
            parts.append(json.loads(path.read_text()))
    return sorted(parts, key=lambda p: p.get("part", 0))


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 10 ** -digits or abs(value) >= 10**6):
            return f"{value:.2e}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:,.{max(0, digits - 2)}f}"
    return str(value)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join(["---"] * len(columns)) + " |"]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]


def part_markdown(part: dict[str, Any]) -> list[str]:
    info = part.get("provenance", {})
    versions = info.get("versions", {})
    peak = part.get("peak")
    lines = [f"## Part {part['part']}: {part['title']}", "",
             f"status **{part['status']}**{' (dry run, CPU, tiny sizes)' if part.get('dry_run') else ''} · "
             f"{part.get('elapsed_s')}s of a {part.get('budget_s')}s budget · git {info.get('git_sha')} · "
             f"{info.get('started_utc')} → {info.get('ended_utc')} UTC", "",
             f"GPU: {info.get('nvidia_smi') or 'none (nvidia-smi absent)'} · torch {versions.get('torch')} "
             f"(CUDA {versions.get('torch_cuda')}) · transformers {versions.get('transformers')} · peft "
             f"{versions.get('peft')} · vllm {versions.get('vllm')} · CPU {info.get('cpu_model')} "
             f"×{info.get('cpu_count')} · load {info.get('load_average')}", ""]
    if peak:
        lines += [f"Peak: {peak['bf16_dense_tflops']} TFLOP/s dense bf16 ({peak['source']}).", ""]
    results = part.get("results", [])
    if part["part"] == 1:
        rows = []
        for r in results:
            if r["status"] != "ok":
                rows.append([r["name"], r["status"], r.get("error") or r.get("reason", "")] + [""] * 12)
                continue
            rows.append([r["name"], r["model"], f"{r['params']['total']:,}", r["mode"],
                         f"{r['sequences']}×{r['seq_len']}", str(r["micro_batch_tokens"]),
                         "on" if r["activation_checkpointing"] else "off",
                         "on" if r.get("torch_compile") else "off", _fmt(r["step_s_mean"]),
                         f"{r['tokens_per_s']:,.0f}", _fmt(r["achieved_tflops"]), _pct(r["mfu"]),
                         _pct(r["mfu_6nd"]), _fmt(r["peak_memory_gib"]), f"{r['timed_steps']} (+{r['warmup_steps']})"])
        lines += _table(["run", "model", "params", "mode", "seqs×len", "micro tokens", "act. ckpt", "compiled",
                         "step s",
                         "tokens/s", "model TFLOP/s", "MFU", "MFU (6ND)", "peak GiB", "timed (+warm-up)"], rows)
    elif part["part"] == 2:
        rows = []
        for r in results:
            if r["status"] != "ok":
                rows.append([r["name"], r["status"], r.get("error") or r.get("reason", "")])
                continue
            rows.append([r["name"], "ok", r.get("summary", "")])
        lines += _table(["check", "status", "figures"], rows)
    else:
        rows = [[r["name"], r["status"], r.get("summary") or r.get("error") or r.get("reason", "")] for r in results]
        lines += _table(["step", "status", "figures"], rows)
    if part.get("notes"):
        lines += [""] + [f"- {n}" for n in part["notes"]]
    return lines + [""]


def write_markdown(parts: list[dict[str, Any]], path: Path) -> None:
    lines = ["# GPU check (issue 29)", "",
             "Written by `python -m bench.gpu_check` (see bench/README.md, \"GPU check\"). MFU formula: the module "
             "docstring of bench/gpu_check.py.", ""]
    for part in parts:
        lines += part_markdown(part)
    path.write_text("\n".join(lines) + "\n")


# --- part 1: throughput and MFU --------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputRun:
    name: str
    model: ModelSpec
    lora: bool
    seq_len: int
    sequences: int
    micro_batch_tokens: int
    estimate_s: float
    activation_checkpointing: bool = False
    sampled_fraction: float = 0.5
    torch_compile: bool = False


def throughput_plan(dry_run: bool) -> list[ThroughputRun]:
    """Priority order: the small model first (quick, and proof the step runs at all), then the 1B
    model the issue's 40% MFU target is about, then LoRA, then larger micro-batches."""
    if dry_run:
        return [ThroughputRun("tiny full", TINY, False, 32, 4, 64, 1),
                ThroughputRun("tiny lora", TINY, True, 32, 4, 64, 1),
                ThroughputRun("tiny full, act. ckpt", TINY, False, 32, 4, 128, 1, activation_checkpointing=True)]
    return [
        ThroughputRun("135m full", SMOLLM2_135M, False, 2048, 32, 16384, 30),
        ThroughputRun("1b full", LLAMA_1B, False, 2048, 16, 8192, 60),
        ThroughputRun("1b full, compiled", LLAMA_1B, False, 2048, 16, 8192, 90, torch_compile=True),
        ThroughputRun("1b full, compiled, micro 16k", LLAMA_1B, False, 2048, 16, 16384, 70, torch_compile=True),
        ThroughputRun("1b lora", LLAMA_1B, True, 2048, 16, 8192, 45),
        ThroughputRun("135m lora", SMOLLM2_135M, True, 2048, 32, 16384, 25),
        ThroughputRun("1b full, micro 16k", LLAMA_1B, False, 2048, 16, 16384, 45),
        ThroughputRun("1b full, act. ckpt, micro 32k", LLAMA_1B, False, 2048, 32, 32768, 60,
                      activation_checkpointing=True),
        ThroughputRun("1b lora, compiled", LLAMA_1B, True, 2048, 16, 8192, 60, torch_compile=True),
        ThroughputRun("135m full, compiled", SMOLLM2_135M, False, 2048, 32, 16384, 40, torch_compile=True),
        ThroughputRun("135m lora, compiled", SMOLLM2_135M, True, 2048, 32, 16384, 40, torch_compile=True),
    ]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_throughput(run: ThroughputRun, *, device: str, dtype: str, work: Path, warmup: int, steps: int,
                       peak: Peak | None) -> dict[str, Any]:
    import torch

    from tracetrain.trainer.backend import StepBatch
    from tracetrain.trainer.local_backend import LocalBackend

    started = time.perf_counter()
    base = model_dir(run.model, work, device=device, save_dtype="bfloat16" if device.startswith("cuda") else "float32")
    built = time.perf_counter()
    cfg = train_config(work, device="cuda" if device.startswith("cuda") else device, dtype=dtype, lora=run.lora,
                       lr=2e-4 if run.lora else 1e-5, micro_batch_tokens=run.micro_batch_tokens,
                       activation_checkpointing=run.activation_checkpointing, torch_compile=run.torch_compile)
    torch.manual_seed(cfg.seed)
    backend = LocalBackend(cfg, base, None)
    loaded = time.perf_counter()
    counts = parameter_counts(backend.model)
    samples, advantages = random_batch(run.sequences, run.seq_len, run.model.vocab,
                                       sampled_fraction=run.sampled_fraction)
    flops = step_flops(run.model, counts, samples, lora=run.lora)
    batch = StepBatch(samples, advantages)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    figures: dict[str, Any] = {}
    losses = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        figures = backend.step(batch)
        _sync(device)
        elapsed = time.perf_counter() - t0
        losses.append(float(figures["loss"]))
        mfu = flops["total"] / elapsed / (peak.tflops * 1e12) if peak else None
        log(f"  {run.name} step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: {elapsed:.3f}s, "
            f"{flops['tokens'] / elapsed:,.0f} tokens/s, {flops['total'] / elapsed / 1e12:.1f} model TFLOP/s"
            + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ""))
        if i >= warmup:
            times.append(elapsed)
    mean = sum(times) / len(times)
    achieved = flops["total"] / mean
    memory = figures.get("memory", [{}])[0]
    peak_bytes = torch.cuda.max_memory_allocated() if device.startswith("cuda") else memory.get("peak_bytes", 0)
    del backend
    mfu_mean = achieved / (peak.tflops * 1e12) if peak else None
    summary = (f"{mean:.3f}s per step, {flops['tokens'] / mean:,.0f} tokens/s, {achieved / 1e12:.1f} model TFLOP/s"
               + (f", MFU {100 * mfu_mean:.1f}%" if mfu_mean is not None else "")
               + f", peak {peak_bytes / 2**30:.1f} GiB")
    return {"model": run.model.name, "model_about": run.model.about, "mode": "lora" if run.lora else "full",
            "params": counts, "seq_len": run.seq_len, "sequences": run.sequences, "tokens_per_step": flops["tokens"],
            "sampled_fraction": run.sampled_fraction, "micro_batch_tokens": run.micro_batch_tokens,
            "micro_batches": figures.get("micro_batches"), "activation_checkpointing": run.activation_checkpointing,
            "torch_compile": run.torch_compile,
            "dtype": dtype, "device": device, "warmup_steps": warmup, "timed_steps": len(times),
            "step_s": [round(t, 4) for t in times], "step_s_mean": mean, "step_s_median": statistics.median(times),
            "step_s_min": min(times), "step_s_max": max(times), "tokens_per_s": flops["tokens"] / mean,
            "model_flops_per_step": flops, "achieved_tflops": achieved / 1e12,
            "mfu": mfu_mean, "summary": summary,
            "mfu_6nd": flops["six_nd"] / mean / (peak.tflops * 1e12) if peak and not run.lora else None,
            "peak_memory_gib": peak_bytes / 2**30, "param_bytes": memory.get("param_bytes"),
            "optimizer_bytes": memory.get("optimizer_bytes"), "build_s": built - started, "load_s": loaded - built,
            "loss_first": losses[0], "loss_last": losses[-1], "grad_norm_last": figures.get("grad_norm")}


def run_part1(part: Part, *, device: str, dtype: str, work: Path, warmup: int, steps: int,
              runs: str | None = None) -> None:
    from tracetrain.trainer.step import train_step

    peak = peak_for(provenance(part.sha, part.started_run).get("device_name")) if device.startswith("cuda") else None
    part.settings = {"device": device, "dtype": dtype, "warmup_steps": warmup, "timed_steps": steps,
                     "step": f"{train_step.__module__}.train_step via LocalBackend.step (algorithm rl, verl "
                             "policy loss 'vanilla', tis_cap 2.0, kl_coef 0, fused AdamW)",
                     "peak_tflops": peak.tflops if peak else None}
    if peak is None:
        part.notes.append("no peak known for this device: MFU is not computed")
    part.notes.append("MFU counts model FLOPs (formula in bench/gpu_check.py's docstring); recomputation under "
                      "activation checkpointing is not counted. Step time is wall time around LocalBackend.step, "
                      "CUDA synchronised, batch collation included.")
    if runs:
        part.notes.append(f"only the runs matching `{runs}` (--runs)")
    for run in throughput_plan(part.dry_run):
        if runs and not re.search(runs, run.name):
            continue
        part.measure(run.name, run.estimate_s, functools.partial(
            measure_throughput, run, device=device, dtype=dtype, work=work, warmup=warmup, steps=steps, peak=peak))
    best = [r for r in part.results if r["status"] == "ok" and r.get("model") == LLAMA_1B.name
            and r.get("mode") == "full" and r.get("mfu") is not None]
    if best:
        top = max(best, key=lambda r: r["mfu"])
        verdict = "meets" if top["mfu"] >= 0.40 else "misses"
        part.notes.append(f"best 1B full fine-tuning MFU {100 * top['mfu']:.1f}% ({top['name']}): {verdict} the "
                          "issue's 40% target")


# --- part 2: equivalence and precision ------------------------------------------------------------------


def logprob_precision(base: Path, samples: list[Sample], *, device: str, work: Path) -> dict[str, Any]:
    """The trainer's logprobs (SampledLogits + sequence_logprobs under the local backend's autocast) in
    bf16 on `device`, and in float32 on `device`, against float32 on the CPU, over the sampled tokens."""
    import torch

    from tracetrain.trainer.checkpoint import build_model
    from tracetrain.trainer.data import collate
    from tracetrain.trainer.devices import autocast
    from tracetrain.trainer.step import SampledLogits, sequence_logprobs

    cfg32 = train_config(work, device="cpu", dtype="float32", lora=False)
    cfg16 = train_config(work, device="cpu", dtype="bfloat16", lora=False)
    policy = SampledLogits(build_model(base, cfg32)).eval()
    micro = collate(samples, list(range(len(samples))), 0)
    where = micro.mask > 0
    with torch.no_grad():
        reference, entropy = sequence_logprobs(policy, micro, entropy=True)
        policy.to(device)
        on_device = micro.to(device)
        with autocast(cfg16, device):
            bf16, _ = sequence_logprobs(policy, on_device)
        fp32, _ = sequence_logprobs(policy, on_device)
    del policy
    assert entropy is not None
    ref = reference[where]

    def stats(values: torch.Tensor) -> dict[str, float]:
        diff = (values.cpu()[where] - ref).abs()
        return {"max": float(diff.max()), "mean": float(diff.mean()), "p99": float(torch.quantile(diff, 0.99))}

    return {"positions": int(where.sum()), "reference_entropy_mean": float(entropy[where].mean()),
            "reference_logprob_mean": float(ref.mean()), "bf16_vs_cpu_fp32": stats(bf16),
            "fp32_vs_cpu_fp32": stats(fp32)}


def precision_summary(figures: dict[str, Any]) -> str:
    b, f = figures["bf16_vs_cpu_fp32"], figures["fp32_vs_cpu_fp32"]
    return (f"{figures['positions']} tokens, reference entropy {figures['reference_entropy_mean']:.2f} nats; "
            f"|bf16 − fp32 CPU| max {b['max']:.3g} mean {b['mean']:.3g} p99 {b['p99']:.3g}; "
            f"|fp32 device − fp32 CPU| max {f['max']:.3g}")


def train_on_patterns(spec: ModelSpec, *, device: str, dtype: str, work: Path, steps: int, count: int,
                      seq_len: int) -> tuple[Path, list[float]]:
    """`steps` of the project's SFT step on `pattern_batch`es from random weights: a model whose
    predictions are confident, like a trained one's."""
    import torch

    from tracetrain.trainer.backend import StepBatch
    from tracetrain.trainer.local_backend import LocalBackend

    base = model_dir(spec, work, device=device)
    path = work / f"{spec.name}-patterns-{steps}"
    if (path / "model.safetensors").exists():
        return path, []
    cfg = train_config(work, algorithm="sft", sft_min_reward=0.0, lora=False, lr=5e-4, device=device,
                       dtype=dtype, micro_batch_tokens=count * seq_len)
    torch.manual_seed(cfg.seed)
    backend = LocalBackend(cfg, base, None)
    losses = []
    for step in range(steps):
        figures = backend.step(StepBatch(pattern_batch(count, seq_len, spec.vocab, seed=step)))
        losses.append(float(figures["loss"]))
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    backend.save(path, merged=False)
    del backend
    return path, losses


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fsdp_step(cfg: TrainConfig, base: Path, samples: list[Sample], advantages: list[float]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step of `FSDPWorker` with world size 1 in this process (no Ray, no torchrun): the process
    group over a tcp:// store, NCCL on a GPU and gloo on the CPU. `FSDPWorker.setup` is not called: it
    is a Ray actor's method and asks Ray about its node (outside an actor that starts a Ray instance,
    which the carried, slimmed Ray cannot); its body is mirrored here, and the sharding (`_shard`), the
    step and the weight gathering are the worker's own."""
    import torch
    import torch.distributed as dist

    from tracetrain.trainer import checkpoint
    from tracetrain.trainer.data import pack
    from tracetrain.trainer.devices import resolve_device
    from tracetrain.trainer.fsdp_worker import FSDPWorker
    from tracetrain.trainer.step import BatchShare, SampledLogits

    threads = torch.get_num_threads()
    worker = FSDPWorker(0, 1)
    worker.cfg = cfg
    worker.device = resolve_device(cfg)
    try:
        if worker.device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if worker.device == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        torch.manual_seed(cfg.seed)  # as setup does: LoRA's initialisation must match the local backend's
        worker.model = checkpoint.build_model(base, cfg).to(worker.device)
        if cfg.activation_checkpointing:
            worker.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        worker.policy = worker._shard(SampledLogits(worker.model))
        worker.optimizer = torch.optim.AdamW([p for p in worker.model.parameters() if p.requires_grad], lr=cfg.lr,
                                             weight_decay=cfg.weight_decay)
        worker.reference = None
        worker.pad_id = int(getattr(worker.model.config, "pad_token_id", None) or 0)
        lengths = [len(s.input_ids) for s in samples]
        passes = len(pack(list(range(len(samples))), lengths, cfg.micro_batch_tokens))
        share = BatchShare(sum(s.num_sampled for s in samples), len(samples), 1, passes, True)
        figures = worker.step(samples, advantages, share)
        weights = worker.weights()
    finally:
        worker.close()
        torch.set_num_threads(threads)
    return figures, weights


def fsdp_vs_local(base: Path, *, device: str, dtype: str, lora: bool, samples: list[Sample],
                  advantages: list[float], micro_batch_tokens: int, work: Path) -> dict[str, Any]:
    """One local step and one FSDP2 step (world size 1) from the same weights and seed on the same batch."""
    import torch

    from tracetrain.trainer.backend import StepBatch
    from tracetrain.trainer.local_backend import LocalBackend

    values: dict[str, Any] = {"device": "cuda" if device.startswith("cuda") else device, "dtype": dtype,
                              "lora": lora, "lora_rank": 8, "lr": 1e-3, "micro_batch_tokens": micro_batch_tokens}
    cfg = train_config(work, **values)
    torch.manual_seed(cfg.seed)
    local = LocalBackend(cfg, base, None)
    before = {k: v.detach().cpu().clone() for k, v in local.model.named_parameters() if v.requires_grad}
    local_figures = local.step(StepBatch(samples, advantages))
    after = {k: v.detach().cpu().clone() for k, v in local.model.named_parameters() if v.requires_grad}
    del local
    free_memory()
    fsdp_figures, weights = fsdp_step(train_config(work, backend="fsdp", **values), base, samples, advantages)
    missing = sorted(set(after) - set(weights))
    if missing:
        raise RuntimeError(f"the FSDP state lacks {missing[:3]}")
    difference = max(float((weights[k].float() - v).abs().max()) for k, v in after.items())
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)

    def relative(key: str) -> float:
        return abs(fsdp_figures[key] - local_figures[key]) / max(abs(local_figures[key]), 1e-12)

    expect = ("equal to float32 rounding" if dtype == "float32" else
              "not equal: FSDP casts every parameter to bf16 (MixedPrecisionPolicy) where the local backend "
              "autocasts the matmuls only, so the loss agrees to bf16 precision and a weight whose gradient is "
              "tiny may step the other way (AdamW's first step is about ±lr)")
    return {"dtype": dtype, "lora": lora, "expect": expect, "max_abs_weight_difference": difference,
            "max_abs_weight_moved": moved,
            "loss_local": local_figures["loss"], "loss_fsdp": fsdp_figures["loss"],
            "grad_norm_local": local_figures["grad_norm"], "grad_norm_fsdp": fsdp_figures["grad_norm"],
            "loss_relative_difference": relative("loss"), "grad_norm_relative_difference": relative("grad_norm"),
            "trainable_tensors": len(after)}


def fsdp_summary(figures: dict[str, Any]) -> str:
    return (f"max |w_fsdp − w_local| {figures['max_abs_weight_difference']:.3g} (the step moved weights by up to "
            f"{figures['max_abs_weight_moved']:.3g}); loss rel. diff {figures['loss_relative_difference']:.2g}, "
            f"grad norm rel. diff {figures['grad_norm_relative_difference']:.2g}"
            + ("" if figures["dtype"] == "float32" else "; bf16: FSDP casts every parameter, the local backend "
               "autocasts matmuls, so only the loss compares"))


def lora_vs_merged(base: Path, *, device: str, samples: list[Sample], advantages: list[float],
                   micro_batch_tokens: int, work: Path) -> dict[str, Any]:
    """One float32 LoRA step, saved as the trainer saves it (adapter and `merged/`); then the adapter
    applied with PEFT on the base model, and the merged weights, evaluated on `device` on the same tokens."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tracetrain.trainer import checkpoint
    from tracetrain.trainer.backend import StepBatch
    from tracetrain.trainer.data import collate
    from tracetrain.trainer.local_backend import LocalBackend
    from tracetrain.trainer.step import SampledLogits, sequence_logprobs

    cfg = train_config(work, device="cuda" if device.startswith("cuda") else device, dtype="float32", lora=True,
                       lr=1e-2, micro_batch_tokens=micro_batch_tokens)
    torch.manual_seed(cfg.seed)
    backend = LocalBackend(cfg, base, None)
    backend.step(StepBatch(samples, advantages))
    path = work / "lora-v1"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    backend.save(path, merged=True)
    del backend
    micro = collate(samples, list(range(len(samples))), 0).to(device)
    where = micro.mask > 0

    def logprobs(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return sequence_logprobs(SampledLogits(model.to(device)).eval(), micro)[0][where].cpu()

    plain: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, attn_implementation="sdpa")
    base_lp = logprobs(plain)
    adapter_lp = logprobs(PeftModel.from_pretrained(plain, str(path)))
    merged: Any = AutoModelForCausalLM.from_pretrained(str(path / checkpoint.MERGED_DIR), dtype=torch.float32,
                                                       attn_implementation="sdpa")
    merged_lp = logprobs(merged)
    return {"positions": int(where.sum()), "max_abs_adapter_vs_merged": float((adapter_lp - merged_lp).abs().max()),
            "mean_abs_adapter_vs_merged": float((adapter_lp - merged_lp).abs().mean()),
            "max_abs_adapter_vs_base": float((adapter_lp - base_lp).abs().max())}


def run_part2(part: Part, *, device: str, dtype: str, work: Path) -> None:
    spec = TINY if part.dry_run else SMOLLM2_135M
    seq_len, count = (32, 4) if part.dry_run else (512, 8)
    trained_steps = 3 if part.dry_run else 60
    part.settings = {"device": device, "dtype": dtype, "model": spec.name, "precision_batch": f"{count}×{seq_len}",
                     "pattern_training_steps": trained_steps}
    if not device.startswith("cuda"):
        part.notes.append("no GPU: the device side of each comparison ran on the CPU")
    elif (gpus := _gpu_count()) == 1:
        part.notes.append("one GPU: the FSDP2 comparison runs with world size 1 (NCCL's collectives on one rank)")
    else:
        part.notes.append(f"{gpus} GPUs visible; the FSDP2 comparison still runs with world size 1 in-process")
    part.notes.append("random weights predict almost uniformly (entropy near log V): the init rows are a floor for "
                      "bf16's error; the pattern-trained rows stand in for a trained model's confident predictions")

    def init_precision() -> dict[str, Any]:
        base = model_dir(spec, work, device=device)
        samples, _ = random_batch(count, seq_len, spec.vocab, seed=1)
        figures = logprob_precision(base, samples, device=device, work=work)
        return {**figures, "summary": precision_summary(figures)}

    def fsdp(lora: bool, precision: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            samples, advantages = random_batch(count, seq_len // 2, spec.vocab, seed=2)
            figures = fsdp_vs_local(model_dir(spec, work, device=device), device=device, dtype=precision, lora=lora,
                                    samples=samples, advantages=advantages, micro_batch_tokens=seq_len,
                                    work=work)
            return {**figures, "summary": fsdp_summary(figures)}
        return run

    def merged() -> dict[str, Any]:
        samples, advantages = random_batch(count, seq_len // 2, spec.vocab, seed=3)
        figures = lora_vs_merged(model_dir(spec, work, device=device), device=device, samples=samples,
                                 advantages=advantages, micro_batch_tokens=seq_len, work=work)
        summary = (f"max |adapter − merged| {figures['max_abs_adapter_vs_merged']:.3g} nats over "
                   f"{figures['positions']} tokens (the adapter moved logprobs by up to "
                   f"{figures['max_abs_adapter_vs_base']:.3g})")
        return {**figures, "summary": summary}

    def trained_precision() -> dict[str, Any]:
        path, losses = train_on_patterns(spec, device=device, dtype=dtype, work=work, steps=trained_steps,
                                         count=16, seq_len=min(seq_len, 256))
        samples = pattern_batch(count, seq_len, spec.vocab, seed=10_000)
        figures = logprob_precision(path, samples, device=device, work=work)
        return {**figures, "training_losses": losses[:1] + losses[-1:],
                "summary": precision_summary(figures) + (f"; SFT loss {losses[0]:.2f} → {losses[-1]:.2f}"
                                                         if losses else "")}

    def large_precision() -> dict[str, Any]:
        big = TINY if part.dry_run else LLAMA_1B
        samples, _ = random_batch(max(1, count // 2), seq_len, big.vocab, seed=4)
        figures = logprob_precision(model_dir(big, work, device=device), samples, device=device, work=work)
        return {**figures, "model": big.name, "summary": precision_summary(figures)}

    part.measure(f"logprobs bf16 vs float32, {spec.name} init", 20, init_precision)
    part.measure(f"fsdp2 (world 1) vs local, full float32, {spec.name}", 25, fsdp(False, "float32"))
    part.measure(f"lora adapter vs merged, float32, {spec.name}", 20, merged)
    part.measure(f"fsdp2 (world 1) vs local, lora float32, {spec.name}", 20, fsdp(True, "float32"))
    part.measure(f"logprobs bf16 vs float32, {spec.name} pattern-trained", 40, trained_precision)
    part.measure(f"fsdp2 (world 1) vs local, full bf16, {spec.name}", 25, fsdp(False, "bfloat16"))
    large = "tiny (standing in for llama-1b)" if part.dry_run else LLAMA_1B.name
    part.measure(f"logprobs bf16 vs float32, {large} init", 50, large_precision)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- part 3: vLLM on the GPU (carried by bench/gpu_carry.py) ---------------------------------------------


def vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """The interpreter that runs vLLM, and why: `--vllm-python`, else this one when it can import vLLM."""
    if explicit:
        return explicit, f"--vllm-python {explicit}"
    done = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, timeout=300, check=False)
    if done.returncode == 0:
        return sys.executable, f"vllm {done.stdout.strip()} in {sys.executable}"
    reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"`import vllm` fails in {sys.executable}: {reason[:300]}"


def publish_latency(spec: ModelSpec, *, python: str, device: str, dtype: str, work: Path, memory_share: float,
                    repeats: int) -> dict[str, Any]:
    """A vLLM server on `spec`'s random weights; the trainer's LoRA adapter and full checkpoint published
    into it with the project's publishers, each timed from `publish` called to `publish` returned, then
    one completion to show the server still answers. Full weights go both ways: read from the checkpoint on
    disk, and sent from memory (`train.weight_transfer`: CUDA IPC on a GPU, shared memory on CPU) from a
    model holding the checkpoint's weights on the trainer's device. The server loads the weights written to
    disk, not `--load-format dummy`: vLLM refuses `reload_weights` on a model loaded that way ("Model
    reloading with `dummy` format"), which is the full-reload path."""
    import asyncio

    import torch

    from tracetrain.engines.probe import Probe, ProbeCheck, write_probe
    from tracetrain.engines.publishing import Checkpoint
    from tracetrain.engines.vllm import VLLMEngine
    from tracetrain.engines.vllm_publish import VLLMLoRAPublisher, VLLMReloadPublisher
    from tracetrain.engines.vllm_server import VLLMServer, http_client
    from tracetrain.engines.weight_transfer import BACKENDS, server_config
    from tracetrain.trainer.backend import StepBatch
    from tracetrain.trainer.local_backend import LocalBackend

    base = model_dir(spec, work, device=device, save_dtype="bfloat16", tokenizer=True)
    probe_ids = [3 + (7 * t) % min(spec.vocab - 3, 4096) for t in range(PROBE_TOKENS)]
    checkpoints: dict[str, Path] = {}
    for lora in (True, False):
        cfg = train_config(work, device="cuda" if device.startswith("cuda") else device, dtype=dtype, lora=lora,
                           lora_rank=16, micro_batch_tokens=4096)
        torch.manual_seed(cfg.seed)
        backend = LocalBackend(cfg, base, None)
        backend.step(StepBatch(*random_batch(4, 512, spec.vocab)))
        path = work / f"{spec.name}-{'lora' if lora else 'full'}-v1"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        backend.save(path, merged=False)
        write_probe(path, Probe(probe_ids, backend.logprobs(probe_ids), dtype))
        del backend
        free_memory()
        checkpoints["lora" if lora else "full"] = path
    checkpoints["wrong"] = wrong_adapter(checkpoints["lora"], work / f"{spec.name}-lora-wrong")
    extra = ["--gpu-memory-utilization", str(memory_share)] if device.startswith("cuda") else []
    times: dict[str, list[float]] = {"lora": [], "full": [], "memory": []}
    transfer = "ipc" if device.startswith("cuda") else "shm"
    routes: list[str | None] = []
    start_s: dict[str, float] = {}
    probes: dict[str, dict[str, Any]] = {}
    served_dtype = "bfloat16" if device.startswith("cuda") else "float32"
    check = ProbeCheck(served_dtype)
    answered = True

    async def probe(engine: VLLMEngine, name: str, model: str, directory: Path) -> None:
        result = await check(engine, model, directory)
        assert result is not None
        probes[name] = {"mean_diff": result.mean_diff, "max_diff": result.max_diff, "tolerance": result.tolerance,
                        "ok": result.ok}

    async def publish_lora(engine: VLLMEngine) -> None:
        publisher = VLLMLoRAPublisher(engine)
        for version in range(1, repeats + 1):
            t0 = time.perf_counter()
            await publisher.publish(Checkpoint(version, checkpoints["lora"], "lora"))
            times["lora"].append(time.perf_counter() - t0)
        await probe(engine, "lora", engine.served_model, checkpoints["lora"])
        await publisher.publish(Checkpoint(repeats + 1, checkpoints["wrong"], "lora"))
        await probe(engine, "wrong lora (caught?)", engine.served_model, checkpoints["wrong"])

    async def publish_full(engine: VLLMEngine) -> None:
        publisher = VLLMReloadPublisher(engine, base)
        for version in range(1, repeats + 1):
            t0 = time.perf_counter()
            await publisher.publish(Checkpoint(version, checkpoints["full"], "full"))
            times["full"].append(time.perf_counter() - t0)
        await probe(engine, "full", engine.model_name, checkpoints["full"])
        # the same weights again, from memory: the base first, so the probe cannot pass on the disk's reload
        await publisher.publish(Checkpoint(repeats + 1, base, "full"))
        from transformers import AutoModelForCausalLM

        held: Any = AutoModelForCausalLM.from_pretrained(str(checkpoints["full"]), dtype=getattr(torch, served_dtype))
        held.to(device)
        sender = VLLMReloadPublisher(engine, base, transfer=BACKENDS[transfer])
        for version in range(repeats + 2, 2 * repeats + 2):
            t0 = time.perf_counter()
            await sender.publish(Checkpoint(version, checkpoints["full"], "full", weights=held.state_dict().items))
            times["memory"].append(time.perf_counter() - t0)
            routes.append(sender.last_route)
        await probe(engine, "full from memory", engine.model_name, checkpoints["full"])
        del held

    # Two servers, as `serve` starts them: with --enable-lora for LoRA publishing, without it for full
    # reloads (vLLM 0.26's GPU runner cannot reload full weights into a model wrapped for LoRA).
    for kind, publish in (("lora", publish_lora), ("full", publish_full)):
        transfer_args, transfer_env = server_config(transfer) if kind == "full" else ([], {})
        server = VLLMServer(base, served_model_name="gpu-check", python=python,
                            dtype="bfloat16" if device.startswith("cuda") else "float32", max_model_len=2048,
                            enable_lora=kind == "lora", max_lora_rank=16, extra_args=[*extra, *transfer_args],
                            env=transfer_env, log_path=work / f"vllm-{spec.name}-{kind}.log")
        started = time.perf_counter()
        server.start()
        start_s[kind] = time.perf_counter() - started
        try:
            asyncio.run(publish(VLLMEngine(server.url, server.model_name, timeout=120)))
            with http_client(server.url, timeout=60) as client:
                answer = client.post("/v1/completions", json={"model": server.model_name, "prompt": [5, 6, 7],
                                                               "max_tokens": 1})
            answered = answered and answer.status_code == 200
        finally:
            server.stop()
    probed = "; ".join(f"{name} mean {p['mean_diff']:.2e} max {p['max_diff']:.2e} {'ok' if p['ok'] else 'REFUSED'}"
                       for name, p in probes.items())
    return {"model": spec.name, "server_start_s": start_s, "lora_publish_s": times["lora"],
            "full_reload_s": times["full"], "full_memory_s": times["memory"], "memory_routes": routes,
            "transfer": transfer, "answers_after": answered, "probes": probes,
            "summary": f"{spec.name}: servers up in {start_s['lora']:.0f}s and {start_s['full']:.0f}s; LoRA load "
                       f"{_seconds(times['lora'])}; full reload from disk {_seconds(times['full'])}; full from "
                       f"memory ({transfer}) {_seconds(times['memory'])}, went {'/'.join(map(str, routes))}; "
                       f"answers after: {answered}; probe ({served_dtype}, tolerance {check.tolerance:.0e} mean): "
                       f"{probed}"}


PROBE_TOKENS = 64
"""Tokens of part 3's publish probe: the trainer's logprobs of them go into each checkpoint (engines/probe.py)."""


def wrong_adapter(adapter: Path, target: Path) -> Path:
    """A copy of `adapter` carrying its probe but other weights (every LoRA B redrawn): what a replica that
    silently loads the wrong adapter serves. The probe must refuse it."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(adapter, target)
    weights = target / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    generator = torch.Generator().manual_seed(1)
    redrawn = {name: (torch.randn(t.shape, generator=generator, dtype=torch.float32) * 0.1).to(t.dtype)
               if "lora_B" in name else t for name, t in tensors.items()}
    save_file(redrawn, str(weights))
    return target


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}s" for v in values) or "none"


LEARN_SPEC = ModelSpec("smollm2-body-v64", 576, 30, 9, 3, 1536, 64,
                       "SmolLM2-135M's decoder with a 64-word vocabulary, random weights: a task it can learn in "
                       "minutes")
TARGET_WORDS = frozenset(f"t{i}" for i in range(3, 11))
"""Part 3's learning task: the reward is the share of these 8 words (of 61) in the answer, 0.13 by chance."""


def target_share(text: str) -> float:
    words = text.split()
    return sum(word in TARGET_WORDS for word in words) / len(words) if words else 0.0


def serve_train_end_to_end(spec: ModelSpec, *, python: str, device: str, work: Path, memory_share: float,
                           timeout_s: float, learn_s: float) -> dict[str, Any]:
    """`tracetrain serve --train` on the GPU with the settings of issue 29 (engine.gpus, train.gpus,
    engine.memory_share, engine.sleep: vLLM sleeps during each sync step), agents on the gateway for
    `learn_s` seconds: rounds of 8 sessions (2 groups of 4), each rewarded with the share of
    TARGET_WORDS in its answer. Reports versions per minute, reward per served version, failed calls."""
    import httpx
    import yaml

    base = model_dir(spec, work, device=device, save_dtype="bfloat16", tokenizer=True)
    for stale in (work / "serve.db", work / "serve-ckpt"):  # a fresh store and trainer each run
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    port = free_port()
    gpu = device.startswith("cuda")
    engine: dict[str, Any] = {"kind": "vllm", "model": str(base), "served_model_name": "gpu-check",
                              "vllm_python": python}
    config = {"gateway": {"host": "127.0.0.1", "port": port}, "engine": engine,
              "store": {"url": f"sqlite:///{work / 'serve.db'}"},
              "train": {"device": "cuda" if gpu else "cpu", "dtype": "bfloat16" if gpu else "float32", "lora": True,
                        "mode": "sync", "batch_sessions": 8, "min_sessions": 8, "poll_s": 0.2, "lr": 1e-3,
                        "group_settle_s": 0, "fill_timeout_s": 2, "micro_batch_tokens": 4096,
                        "checkpoint_dir": str(work / "serve-ckpt")}}
    if gpu:
        engine.update({"gpus": [0], "memory_share": memory_share, "sleep": "auto"})
        config["train"]["gpus"] = [0]  # type: ignore[index]
    config_path = work / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = work / "serve.log"
    started = time.perf_counter()
    with open(log_path, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tracetrain.cli", "--config", str(config_path), "serve",
                                    "--train"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    calls: list[dict[str, Any]] = []

    def attempt(client: httpx.Client, session: str, group: str) -> dict[str, Any]:
        try:
            reply = client.post(f"{url}/s/{session}/g/{group}/v1/completions",
                                json={"model": "gpu-check", "prompt": "t11 t12 t13", "max_tokens": 16,
                                      "temperature": 1.0})
            reply.raise_for_status()
            reward = target_share(reply.json()["choices"][0]["text"])
            client.post(f"{url}/v1/rewards", json={"session_id": session, "reward": reward,
                                                   "final": True}).raise_for_status()
            return {"ok": True, "reward": reward, "version": int(reply.headers.get("x-policy-version", "0")),
                    "t": time.perf_counter() - started}
        except httpx.HTTPError as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200], "t": time.perf_counter() - started}

    try:
        with httpx.Client(timeout=60) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"serve exited with {process.returncode}: {_tail(log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/health").status_code == 200:
                        break
                if time.perf_counter() - started > timeout_s:
                    raise TimeoutError(f"serve not healthy after {timeout_s:.0f}s: {_tail(log_path)}")
                time.sleep(1)
            healthy_s = time.perf_counter() - started
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(8) as pool:
                round_ = 0
                while time.perf_counter() - started < healthy_s + learn_s:
                    if process.poll() is not None:
                        raise RuntimeError(f"serve exited with {process.returncode}: {_tail(log_path)}")
                    futures = [pool.submit(attempt, client, f"r{round_}-{i}", f"r{round_}-g{i // 4}")
                               for i in range(8)]
                    calls.extend(f.result() for f in futures)
                    round_ += 1
            learned_s = time.perf_counter() - started - healthy_s
            policies = client.get(f"{url}/v1/policies").json()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
    answered = [c for c in calls if c["ok"]]
    by_version: dict[int, list[float]] = {}
    for c in answered:
        by_version.setdefault(c["version"], []).append(c["reward"])
    curve = [{"version": v, "sessions": len(r), "mean_reward": statistics.fmean(r)}
             for v, r in sorted(by_version.items())]
    last = max(by_version) if by_version else 0
    first_served = min((c["t"] for c in answered if c["version"] >= 1), default=None)
    failed = len(calls) - len(answered)
    rewards = [point["mean_reward"] for point in curve]
    shown = ", ".join(f"v{p['version']} {p['mean_reward']:.2f} (n={p['sessions']})" for p in curve[:3])
    if len(curve) > 3:
        shown += ", …, " + ", ".join(f"v{p['version']} {p['mean_reward']:.2f} (n={p['sessions']})"
                                     for p in curve[-2:])
    return {"status": "ok" if failed == 0 and last >= 1 else "failed",
            "healthy_s": healthy_s, "learn_s": learned_s, "first_version_served_s": first_served,
            "calls": len(calls), "failed_calls": failed, "errors": [c["error"] for c in calls if not c["ok"]][:5],
            "versions_served": last, "versions_per_min": 60 * last / learned_s if learned_s else None,
            "reward_by_version": curve, "config": config, "policies": policies.get("data", policies)
            if isinstance(policies, dict) else policies,
            "summary": f"healthy after {healthy_s:.0f}s; {len(calls)} calls in {learned_s:.0f}s, {failed} failed; "
                       f"{last} versions served ({60 * last / learned_s:.1f}/min); mean reward by served version "
                       f"(chance 0.13): {shown}; first {rewards[0] if rewards else float('nan'):.2f} → last "
                       f"{rewards[-1] if rewards else float('nan'):.2f}"}


def _tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])[-1500:]
    return ""


def run_part3(part: Part, *, device: str, dtype: str, work: Path, explicit_python: str | None,
              memory_share: float) -> None:
    part.notes.append("vLLM 0.26.0 (the build for torch 2.11) carried in chunks over several device calls: "
                      "bench/gpu_carry.py; VLLM_USE_FLASHINFER_SAMPLER=0 (FlashInfer is not carried)")
    python, why = vllm_python(explicit_python)
    part.settings = {"device": device, "dtype": dtype, "vllm": why, "engine.memory_share": memory_share}
    if python is None:
        part.status = "skipped"
        part.results.append({"name": "vLLM", "status": "skipped", "reason": why})
        log(f"part 3 skipped: {why}")
        return
    specs = [TINY] if part.dry_run else [SMOLLM2_135M, LLAMA_1B]
    learner = TINY if part.dry_run else LEARN_SPEC
    measurements = [
        (f"publish latency and probe, {specs[0].name}", 150, functools.partial(
            publish_latency, specs[0], python=python, device=device, dtype=dtype, work=work,
            memory_share=memory_share, repeats=3)),
        (f"serve --train, agents learning, {learner.name}", 260, functools.partial(
            serve_train_end_to_end, learner, python=python, device=device, work=work, memory_share=memory_share,
            timeout_s=180, learn_s=30 if part.dry_run else 120)),
        (f"publish latency and probe, {specs[-1].name}", 150, functools.partial(
            publish_latency, specs[-1], python=python, device=device, dtype=dtype, work=work,
            memory_share=memory_share, repeats=3)),
    ]
    for name, budget, measure in measurements[:2] if part.dry_run else measurements:
        part.measure(name, 1 if part.dry_run else budget, measure)


# --- the wheels parts 1 and 2 need on the device machine -------------------------------------------------

_IMAGE_PACKAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
DEVICE_IMAGE_PACKAGES = frozenset(_IMAGE_PACKAGE_LIST.split())
"""The device image's Python packages, as its machine notes listed them (2026-11-17): Python 3.12, torch
2.11 with CUDA 13, transformers 5.17, peft."""

CARRIED = ("annotated-types", "pydantic", "pydantic-core", "typing-inspection", "pydantic-settings", "python-dotenv",
           "sqlalchemy", "sqlmodel", "verl", "omegaconf", "antlr4-python3-runtime", "codetiming", "tensordict",
           "pyvers", "ray", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "orjson")
"""What parts 1 and 2 import that the image lacks: tracetrain.config (pydantic, pydantic-settings),
trainer/data.py (sqlmodel, via the store), and verl's algorithm registries (verl/__init__ imports
verl.protocol, which imports ray and tensordict at the top; verl.utils.tracking imports orjson at the top,
which the first device run found missing)."""
OPTIONAL = {"dill": "torch imports it only if present", "zstandard": "httpx decodes zstd only if present",
            "jsonpointer": "jsonschema's format checker, if present",
            "greenlet": "SQLAlchemy's asyncio only"}
"""Imported here when installed, but not needed: left behind."""
SDIST_ONLY = {"antlr4-python3-runtime"}
"""Published as a source archive only (pure Python): built into a wheel here."""
RAY_DROPPED = ("ray/jars/", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet",
               "ray/dashboard/client/build/", "ray/_private/runtime_env/agent/thirdparty_files/")
"""Left out of the carried Ray wheel: the cluster's own programs (GCS server, raylet, Java jars,
dashboard web client, runtime-env agent), which `import ray` never loads. Parts 1 and 2 only import
verl, which imports ray; they never start a cluster. The full wheel is over the 64 MiB carry alone."""


def _distribution_of_files() -> dict[str, str]:
    """Installed file path -> distribution name, from every distribution's RECORD."""
    owners: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = _normal(dist.metadata["Name"] or "")
        for file in dist.files or []:
            if file.suffix in (".py", ".so", ".pyc") or file.name == "__init__.py":
                owners[str(Path(str(dist.locate_file(file))).resolve())] = name
    return owners


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def imported_distributions(modules: list[str]) -> dict[str, str]:
    """Distributions (name -> version) whose modules importing `modules` loads, outside the standard
    library and this repository."""
    before = set(sys.modules)
    for module in modules:
        importlib.import_module(module)
    owners = _distribution_of_files()
    found: dict[str, str] = {}
    for name in set(sys.modules) - before:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file:
            continue
        owner = owners.get(str(Path(file).resolve()))
        if owner and owner != "tracetrain":
            found[owner] = package_version(owner) or "?"
    return dict(sorted(found.items()))


def wheel_plan(imported: dict[str, str]) -> dict[str, Any]:
    """The wheels to carry for parts 1 and 2, at the versions installed here, and any import that no
    list accounts for (a new dependency: add it to CARRIED or OPTIONAL)."""
    carried = {name: package_version(name) for name in CARRIED}
    unaccounted = sorted(n for n in imported if n not in DEVICE_IMAGE_PACKAGES and n not in carried
                         and n not in OPTIONAL)
    commands = []
    for name, version in carried.items():
        if version is None:
            continue
        if name in SDIST_ONLY:
            commands.append(f"python3 -m pip wheel --no-deps --no-binary=:all: -w .whl {name}=={version}")
        else:
            commands.append(f"{PIP_DOWNLOAD} -d .whl {name}=={version}")
    return {"carried": carried, "optional_not_carried": OPTIONAL, "unaccounted": unaccounted,
            "imported_on_image": sorted(n for n in imported if n in DEVICE_IMAGE_PACKAGES),
            "ray_slimmed_without": list(RAY_DROPPED), "pip_commands": commands,
            "fetch_command": "python -m bench.gpu_check --wheels .whl"}


def slim_ray(wheel: Path) -> Path:
    """Rewrite Ray's wheel without RAY_DROPPED (its RECORD without their lines), in place."""
    return drop_from_wheel(wheel, RAY_DROPPED)


def fetch_wheels(target: Path) -> dict[str, Any]:
    """Download (or build) the CARRIED wheels for CPython 3.12 on x86-64 Linux into `target` and slim Ray's."""
    target.mkdir(parents=True, exist_ok=True)
    inside = target.resolve().is_relative_to(REPO_ROOT)
    if inside and subprocess.run(["git", "-C", str(REPO_ROOT), "check-ignore", "-q", str(target)],
                                 check=False).returncode != 0:
        raise SystemExit(f"{target} is inside the repository but not ignored by git; first run: "
                         f"echo /{target.resolve().relative_to(REPO_ROOT)}/ >> .git/info/exclude")
    for name in CARRIED:
        version = package_version(name)
        if version is None:
            raise SystemExit(f"{name} is not installed here: run scripts/setup.sh first")
        if any(_normal(p.name).startswith(_normal(name) + "-" + version) for p in target.glob("*.whl")):
            continue
        if name in SDIST_ONLY:
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", str(target),
                   f"{name}=={version}"]
        else:
            cmd = [sys.executable, "-m", *PIP_DOWNLOAD.split()[2:], "-q", "-d", str(target), f"{name}=={version}"]
        log(" ".join(cmd[2:]))
        subprocess.run(cmd, check=True)
    for wheel in target.glob("ray-*.whl"):
        with zipfile.ZipFile(wheel) as z:
            fat = any(n.startswith(RAY_DROPPED) for n in z.namelist())
        if fat:
            slim_ray(wheel)
    return wheel_sizes(target)


def wheel_sizes(directory: Path) -> dict[str, Any]:
    sizes = {p.name: p.stat().st_size for p in sorted(directory.glob("*.whl"))}
    tree = tracked_tree_bytes()
    total = sum(sizes.values())
    return {"wheels": sizes, "wheels_bytes": total, "tree_bytes": tree,
            "carry_bytes": total + (tree or 0), "limit_bytes": CARRY_LIMIT_BYTES,
            "fits": total + (tree or 0) <= CARRY_LIMIT_BYTES}


def tracked_tree_bytes() -> int | None:
    """Bytes of what the device tool sends besides carried paths: tracked and untracked-not-ignored files."""
    listed = command_output(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"])
    if listed is None:
        return None
    total = 0
    for name in listed.split("\0"):
        with contextlib.suppress(OSError):
            total += (REPO_ROOT / name).stat().st_size if name else 0
    return total


# --- commands for the device tool ------------------------------------------------------------------------


def device_command(parts: tuple[int, ...], sha: str, *, gpu_tests: bool = False) -> str:
    """The one bash command for the device tool (run it with carry [".whl"]): install the carried wheels,
    run the parts with their output in $OUT, then (optionally) the GPU tests under a timeout."""
    label = "".join(str(p) for p in parts)
    run = (f"python3 -m bench.gpu_check --part {','.join(str(p) for p in parts)} --out \"$OUT\" --git-sha {sha} "
           f"2>&1 | tee \"$OUT/gpu_check_part{label}.log\"")
    command = f"set -o pipefail; {WHEEL_INSTALL}; export PYTHONUNBUFFERED=1; nvidia-smi; {run}"
    if gpu_tests:
        command += (f"; timeout {GPU_TESTS_TIMEOUT_S} python3 -m pytest --noconftest -p no:cacheprovider -q -m gpu "
                    "tests/gpu/test_gpu_trainer.py 2>&1 | tee \"$OUT/gpu_tests.log\"")
    return command


def device_commands(sha: str) -> list[dict[str, Any]]:
    return [
        {"what": "parts 1 and 2 and the GPU tests: the one prepared command", "carry": [".whl"],
         "timeout_s": DEVICE_TIMEOUT_S, "command": device_command((1, 2), sha, gpu_tests=True)},
        {"what": "part 1 alone", "carry": [".whl"], "timeout_s": 420, "command": device_command((1,), sha)},
        {"what": "part 2 alone, with the GPU tests", "carry": [".whl"], "timeout_s": 360,
         "command": device_command((2,), sha, gpu_tests=True)},
        {"what": "part 3: several calls, printed by `python -m bench.gpu_carry` (vLLM carried in chunks)",
         "carry": [".gpu-carry/N"], "timeout_s": 595, "command": device_command((3,), sha)},
    ]


# --- entry points ----------------------------------------------------------------------------------------


def run_parts(parts: tuple[int, ...], *, out: Path, dry_run: bool, sha: str, device: str, dtype: str, work: Path,
              warmup: int, steps: int, budget_s: float | None, vllm: str | None, memory_share: float,
              runs: str | None = None) -> None:
    work.mkdir(parents=True, exist_ok=True)
    if parts != (3,):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard bars would bury the progress lines in the returned log
    for number in parts:
        budget = budget_s if budget_s is not None else (120.0 if dry_run else PART_BUDGET_S[number])
        part = Part(number, out, dry_run, sha, budget)
        part.save()
        try:
            if number == 1:
                run_part1(part, device=device, dtype=dtype, work=work, warmup=warmup, steps=steps, runs=runs)
            elif number == 2:
                run_part2(part, device=device, dtype=dtype, work=work)
            else:
                run_part3(part, device=device, dtype=dtype, work=work, explicit_python=vllm,
                          memory_share=memory_share)
        except Exception as exc:  # a part that cannot run at all (an import) still reports why
            part.status = "failed"
            part.notes.append(f"{type(exc).__name__}: {str(exc)[:800]}")
            log(f"part {number} failed: {type(exc).__name__}: {exc}")
        part.finish()


def dry_run(out: Path, sha: str, work: Path, vllm: str | None, budget_s: float | None = None) -> dict[str, Any]:
    """The plan on this CPU: which imports the parts need (before anything else is imported), every part
    at tiny sizes, and the device commands and wheel list."""
    imported = imported_distributions(["tracetrain.trainer.local_backend", "tracetrain.trainer.fsdp_worker", "peft"])
    wheels = wheel_plan(imported)
    import torch

    dtype = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    run_parts(PARTS, out=out, dry_run=True, sha=sha, device="cpu", dtype=dtype, work=work, warmup=1, steps=2,
              budget_s=budget_s, vllm=vllm, memory_share=0.3)
    plan = {"schema": SCHEMA, "dry_run": True, "git_sha": sha, "parts": list(PARTS), "part_titles": PART_TITLES,
            "part_budgets_s": PART_BUDGET_S, "commands": device_commands(sha), "wheels": wheels,
            "imported_distributions": imported}
    whl = REPO_ROOT / ".whl"
    if whl.is_dir() and any(whl.glob("*.whl")):
        plan["wheel_sizes"] = wheel_sizes(whl)
    (out / "gpu_check_plan.json").write_text(json.dumps(plan, indent=2, default=str) + "\n")
    print_plan(plan)
    return plan


def print_plan(plan: dict[str, Any]) -> None:
    print("\n== device tool commands (run from the repository root, carry [\".whl\"]) ==")
    for entry in plan["commands"]:
        print(f"\n# {entry['what']} (timeout_s {entry['timeout_s']}, carry {entry['carry']})\n{entry['command']}")
    wheels = plan["wheels"]
    print("\n== wheels parts 1-2 need that the device image lacks (CPython 3.12, x86-64) ==")
    for name, version in wheels["carried"].items():
        print(f"  {name}=={version}")
    print("  ray is carried without: " + ", ".join(wheels["ray_slimmed_without"]))
    print("  not carried (optional imports): " + ", ".join(f"{k} ({v})" for k, v in wheels["optional_not_carried"]
                                                              .items()))
    if wheels["unaccounted"]:
        print("  WARNING, imported but in no list (the image may lack them): " + ", ".join(wheels["unaccounted"]))
    print("\nfetch them all (slims ray):  " + wheels["fetch_command"])
    print("or one by one:")
    for command in wheels["pip_commands"]:
        print(f"  {command}")
    sizes = plan.get("wheel_sizes")
    if sizes:
        tree = (sizes["tree_bytes"] or 0) / 2**20
        print(f"\n.whl holds {sizes['wheels_bytes'] / 2**20:.1f} MiB, the tree {tree:.1f} MiB: "
              f"{'fits' if sizes['fits'] else 'does NOT fit'} the 64 MiB carry")


def collect(directories: list[Path], results_dir: Path) -> tuple[Path, Path]:
    """Combine the returned part files of one or more device calls into `results_dir/gpu_check.{json,md}`
    through bench.common's writer, each part under its own provenance line, in part order then time.

    A collection replaces the parts it brings and keeps the others from the current file, with their GPU-test
    notes: a task's few device minutes often re-measure one part, and the file must stay the current record of
    all of them. The file's provenance is the first part's, ending when the last part ended."""
    new_parts = [part for directory in directories for part in load_parts(directory)]
    current = results_dir / "gpu_check.json"
    kept_parts: list[dict[str, Any]] = []
    kept_notes: list[str] = []
    if current.is_file():
        old = json.loads(current.read_text())
        brought = {p.get("part") for p in new_parts}
        kept_parts = [p for p in old.get("raw", {}).get("parts", []) if p.get("part") not in brought]
        kept_notes = [n for n in old.get("notes", []) if n.startswith(GPU_TESTS_NOTE)]
    parts = sorted(kept_parts + new_parts, key=lambda p: (p.get("part", 0), p["provenance"].get("started_utc", "")))
    if not parts:
        raise SystemExit(f"no gpu_check_part*.json under {', '.join(map(str, directories))}")
    info = {**parts[0]["provenance"], "ended_utc": max(p["provenance"]["ended_utc"] for p in parts)}
    body = "\n".join(line for part in parts for line in part_markdown(part))
    notes = [f"parts {', '.join(str(p['part']) for p in parts)} measured on the device; a part alone runs as "
             f"`{parts[0].get('device_command', '?')}`",
             "MFU formula: the module docstring of bench/gpu_check.py; how to run: bench/README.md, \"GPU check\"",
             *kept_notes]
    for directory in directories:
        tests = gpu_tests_summary(directory / "gpu_tests.log")
        if tests:
            notes.append(f"{GPU_TESTS_NOTE}{_call_started(directory)} (`pytest -m gpu tests/gpu/...`): {tests}")
    # the folders are where this machine put the returned files: only the count says anything elsewhere
    command = f"python -m bench.gpu_check --collect DIR ... ({len(directories)} device call(s))"
    md_path = write_results("gpu_check", "GPU check (issue 29)", command,
                            [], notes, raw={"schema": SCHEMA, "device_calls": len(directories), "parts": parts},
                            started=run_started(), results_dir=results_dir, body=body, info=info)
    return md_path.with_suffix(".json"), md_path


GPU_TESTS_NOTE = "GPU tests in the device call of "

# the one-line summaries publish_latency and serve_train_end_to_end return, which the GPU tests print
_TEST_FIGURES = re.compile(r"^([\w.-]+: servers up in |healthy after \d+s; ).*")


def _call_started(directory: Path) -> str:
    """When a device call began: its parts' start, or, for a call that only ran the GPU tests, when the log was
    last written (the end of the call, to the second)."""
    started = [p["provenance"].get("started_utc", "") for p in load_parts(directory)]
    if started:
        return min(started)
    written = (directory / "gpu_tests.log").stat().st_mtime
    return utc_text(datetime.fromtimestamp(written, UTC)) + " (log written)"


def gpu_tests_summary(log: Path) -> str | None:
    """pytest's closing line from the GPU tests' log (`5 passed, 2 warnings in 48.80s`), with the names of any
    that failed and the figures the tests printed; None when the log is absent."""
    if not log.is_file():
        return None
    lines = log.read_text(errors="replace").splitlines()
    failed = [line.split(" ", 1)[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    counts = (" passed", " failed", " error", " deselected")
    closing = next((line.strip("= ") for line in reversed(lines) if " in " in line and any(c in line for c in counts)),
                   "no summary line")
    figures = [m.group(0) for line in lines if (m := _TEST_FIGURES.match(line))]
    return (closing + (f"; failed: {', '.join(failed)}" if failed else "")
            + "".join(f"; figures: {f}" for f in figures))


def _parse_parts(value: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in value.split(",") if p.strip())
    if not parts or any(p not in PARTS for p in parts):
        raise argparse.ArgumentTypeError(f"parts are {PARTS}, comma-separated")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--part", type=_parse_parts, help="part(s) to run, e.g. 1 or 1,2")
    action.add_argument("--dry-run", action="store_true", help="every part at tiny sizes on this CPU, and the plan")
    action.add_argument("--collect", type=Path, nargs="+", metavar="DIR",
                        help="returned files of one or more device calls -> bench/results/gpu_check.*")
    action.add_argument("--wheels", type=Path, metavar="DIR", help="fetch the wheels parts 1-2 need into DIR")
    parser.add_argument("--out", type=Path, help="where the part files go ($OUT on the device machine)")
    parser.add_argument("--git-sha", help="the commit being checked (the device's copy may have no .git)")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per throughput run")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per throughput run")
    parser.add_argument("--budget-s", type=float, help="override each part's time budget")
    parser.add_argument("--runs", help="part 1: only the throughput runs whose name this regex finds")
    parser.add_argument("--work-dir", type=Path, default=WORK_DIR)
    parser.add_argument("--vllm-python", help="part 3: the interpreter that runs vLLM (default: this one)")
    parser.add_argument("--engine-memory-share", type=float, default=0.3, help="part 3: vLLM's GPU memory share")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="--collect writes here")
    args = parser.parse_args(argv)
    if args.collect:
        for path in collect(args.collect, args.results_dir):
            print(f"wrote {path}")
        return 0
    if args.wheels:
        sizes = fetch_wheels(args.wheels)
        for name, size in sizes["wheels"].items():
            print(f"  {size / 2**20:7.2f} MiB  {name}")
        print(f"wheels {sizes['wheels_bytes'] / 2**20:.1f} MiB + tree {(sizes['tree_bytes'] or 0) / 2**20:.1f} MiB = "
              f"{sizes['carry_bytes'] / 2**20:.1f} MiB: {'fits' if sizes['fits'] else 'does NOT fit'} 64 MiB")
        return 0 if sizes["fits"] else 1
    if args.out is None:
        parser.error("--out is needed with --part and --dry-run")
    sha = git_sha(args.git_sha)
    if args.dry_run:
        dry_run(args.out, sha, args.work_dir / "dry-run", args.vllm_python, args.budget_s)
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    run_parts(args.part, out=args.out, dry_run=False, sha=sha, device=device, dtype=args.dtype, work=args.work_dir,
              warmup=args.warmup, steps=args.steps, budget_s=args.budget_s, vllm=args.vllm_python,
              memory_share=args.engine_memory_share, runs=args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
