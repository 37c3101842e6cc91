"""Trainer throughput on SmolLM2-135M (fp32), full fine-tuning and LoRA r16, in three parts:

- `mfu`: tokens/s and model FLOPs utilisation of the trainer's own `train_step` in this process;
- `backends`: the `local` backend against `fsdp` with 1 and 2 workers (Ray actors), each arm in a fresh
  process: tokens/s, parameter + optimizer bytes per worker (what FSDP exists to shrink), peak resident
  memory per worker, and FSDP's start-up (Ray, the workers, the process group);
- `shared_prefix`: the demo's batches with `train.shared_prefix` off and on (bench/shared_prefix.py).

    python -m bench.trainer_throughput                       # every part
    python -m bench.trainer_throughput --parts mfu --shapes 32x48+16 --steps 2
    python -m bench.trainer_throughput --parts backends --repeats 1 --arms fsdp-2

MFU is given against two peaks:
- the theoretical fp32 peak of the CPU: cores x clock x fp32 FLOPs per cycle per core, each factor
  printed with where it came from (`theoretical_peak`); the clock is the highest the part can run at,
  so this MFU is a lower bound;
- the measured GEMM rate: the best fp32 matmul rate torch reaches (square and model-shaped GEMMs,
  all of torch's threads), re-measured right before each configuration, so a machine that got busier
  or cooler in between shows in that row's peak, not in its MFU.
Each configuration runs `train_step` (GRPO advantages given, vanilla PPO-clip loss, fused AdamW) on
synthetic samples of the given shape: B sequences of P prompt tokens + C sampled tokens.

Model FLOPs per step, counted the usual way (weights only, plus attention scores):
- forward = 2 x (non-embedding parameters) x all tokens + 2 x hidden x vocab x sampled tokens (the
  trainer projects to the vocabulary only where the loss mask is 1) + 4 x layers x hidden x T^2 per
  sequence (QK^T and AV, not halved for causality);
- full fine-tuning: 3 x forward (the backward pass is twice the forward);
- LoRA: 2 x forward (activation gradients still flow through every frozen weight, weight gradients
  are only the adapters', which are ignored here).
MFU = model FLOPs per second / peak. Optimizer time is inside the step, as in real training.

The backends part runs every arm on the same synthetic batch (seed 0), optimizer settings and
micro-batch budget, arms interleaved and the whole set repeated `--repeats` times, the order rotated.
With fewer cores than workers need, throughput cannot scale with workers: two workers share the cores
one local step uses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import shared_prefix
from bench.common import (
    Part,
    PartRunner,
    ResultTable,
    add_results_dir_argument,
    command_line,
    console,
    parts_parser,
    provenance,
    run_parts,
    run_started,
)
from tracetrain.config import TrainConfig
from tracetrain.engines.models import smollm2_dir
from tracetrain.trainer.checkpoint import build_model
from tracetrain.trainer.data import Sample
from tracetrain.trainer.step import SampledLogits, StepInputs, train_step


@dataclass
class Shape:
    batch: int
    prompt: int
    completion: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """'32x48+16' -> 32 sequences of 48 prompt + 16 sampled tokens."""
        batch, rest = text.split("x")
        prompt, completion = rest.split("+")
        return cls(int(batch), int(prompt), int(completion))

    def __str__(self) -> str:
        return f"{self.batch}x({self.prompt}+{self.completion})"


def matmul_peak(seconds_per_size: float = 2.0) -> tuple[float, str]:
    """Best fp32 GEMM rate in FLOP/s over a few sizes, and which size reached it."""
    best, where = 0.0, ""
    shapes = [(1024, 1024, 1024), (2048, 2048, 2048), (2048, 576, 1536), (2048, 1536, 576)]  # m, k, n
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm-up
        runs, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds_per_size:
            a @ b
            runs += 1
        rate = 2 * m * k * n * runs / (time.perf_counter() - started)
        if rate > best:
            best, where = rate, f"{m}x{k}x{n}"
    return best, where


@dataclass
class Peak:
    flops: float
    derivation: str


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def fp32_flops_per_cycle(info: dict[str, str]) -> tuple[int, str]:
    """fp32 FLOPs one core retires per cycle at best: FMA pipes x fp32 lanes x 2 (an FMA is two FLOPs)."""
    flags = set(info.get("flags", "").split())
    vendor, family = info.get("vendor_id", ""), int(info.get("cpu family", "0"))
    if vendor == "AuthenticAMD" and family >= 0x19:
        # Zen 3 and Zen 4 (family 25): two 256-bit FMA pipes; Zen 4 runs AVX-512 as two 256-bit halves.
        return 2 * 8 * 2, "AMD family 25 (Zen 3/4): 2 FMA pipes x 8 fp32 lanes (256-bit) x 2"
    if "avx512f" in flags:
        return 2 * 16 * 2, "AVX-512 with 2 FMA units: 2 x 16 fp32 lanes x 2"
    if "fma" in flags:
        return 2 * 8 * 2, "AVX2 + FMA: 2 FMA units x 8 fp32 lanes x 2"
    return 4 * 2, "no FMA flag: 4 fp32 lanes (SSE) x 2 (add + multiply)"


def theoretical_peak(clock_ghz: float | None) -> Peak:
    """cores x clock x FLOPs/cycle. The clock: `--clock-ghz`, else cpufreq's maximum, else /proc/cpuinfo's
    MHz (under a hypervisor that is often the base or TSC clock, below what the part boosts to)."""
    info = _cpuinfo()
    cores = len(os.sched_getaffinity(0))
    per_cycle, why = fp32_flops_per_cycle(info)
    max_freq = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if clock_ghz is not None:
        clock, source = clock_ghz, "--clock-ghz"
    elif max_freq.exists():
        clock, source = int(max_freq.read_text()) / 1e6, "cpufreq cpuinfo_max_freq"
    else:
        clock, source = float(info.get("cpu MHz", "0")) / 1e3, "/proc/cpuinfo cpu MHz"
    flops = cores * clock * 1e9 * per_cycle
    return Peak(flops, f"{cores} cores x {clock:.2f} GHz ({source}) x {per_cycle} fp32 FLOP/cycle ({why}) "
                       f"= {flops / 1e9:.1f} GFLOP/s; CPU: {info.get('model name', '?')}")


def samples_for(shape: Shape, vocab: int, rng: random.Random) -> list[Sample]:
    length = shape.prompt + shape.completion
    return [
        Sample(session_id=f"s{i}", group_id=f"g{i // 8}",
               input_ids=[rng.randrange(vocab) for _ in range(length)],
               loss_mask=[0] * shape.prompt + [1] * shape.completion,
               logprobs=[0.0] * shape.prompt + [-2.0] * shape.completion,
               versions=[0] * length, reward=rng.random())
        for i in range(shape.batch)
    ]


def model_flops(model: torch.nn.Module, shape: Shape, lora: bool) -> float:
    config: Any = model.config  # a transformers config; torch types Module attributes as Tensor | Module
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    base = getattr(model, "get_base_model", lambda: model)()
    body = sum(p.numel() for n, p in base.named_parameters() if "embed_tokens" not in n and "lora_" not in n)
    if not getattr(config, "tie_word_embeddings", False):
        body -= hidden * vocab  # the untied head is counted separately, on sampled tokens only
    tokens = shape.batch * (shape.prompt + shape.completion)
    length = shape.prompt + shape.completion
    forward = (2 * body * tokens + 2 * hidden * vocab * shape.batch * shape.completion
               + 4 * layers * hidden * length * length * shape.batch)
    return forward * (2 if lora else 3)


def measure(lora: bool, shape: Shape, steps: int, theoretical: float, cfg_base: TrainConfig) -> dict[str, Any]:
    """One configuration of the mfu part: its figures, and the table row made of them."""
    cfg = cfg_base.model_copy(update={"lora": lora})
    torch.manual_seed(0)
    model = build_model(smollm2_dir(), cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)  # as the trainer
    config: Any = model.config
    samples = samples_for(shape, config.vocab_size, random.Random(0))
    advantages = [s.reward - 0.5 for s in samples]
    pad = config.eos_token_id or 0
    peak, where = matmul_peak(seconds_per_size=1.0)  # right before this configuration, same threads
    console.log(f"GEMM peak before {'LoRA' if lora else 'full'} {shape}: {peak / 1e9:.1f} GFLOP/s ({where})")
    times = []
    for step in range(steps + 1):  # the first step warms up allocators and kernels; not counted
        stats = train_step(SampledLogits(model), optimizer, StepInputs(samples, advantages), cfg, pad)
        if step:
            times.append(stats["step_seconds"])
        console.log(f"{'LoRA' if lora else 'full'} {shape}: step {step}/{steps} "
                    f"{stats['step_seconds']:.1f} s, {stats['tokens_per_second']:.0f} tok/s")
    seconds = sorted(times)[len(times) // 2]
    tokens = shape.batch * (shape.prompt + shape.completion)
    flops = model_flops(model, shape, lora)
    achieved = flops / seconds
    trainable_params = sum(p.numel() for p in trainable)
    figures: dict[str, Any] = {
        "mode": f"LoRA r{cfg.lora_rank}" if lora else "full", "shape": str(shape),
        "trainable_params": trainable_params, "step_s": seconds,
        "tokens_per_s": tokens / seconds, "sampled_tokens_per_s": shape.batch * shape.completion / seconds,
        "model_flops_per_s": achieved, "gemm_peak_flops_per_s": peak, "gemm_peak_shape": where,
        "mfu_vs_gemm": achieved / peak, "mfu_vs_theoretical": achieved / theoretical, "step_times_s": times,
    }
    figures["row"] = [figures["mode"], str(shape), f"{trainable_params / 1e6:.1f}M", f"{seconds:.2f}",
                      f"{tokens / seconds:.0f}", f"{figures['sampled_tokens_per_s']:.0f}", f"{achieved / 1e9:.1f}",
                      f"{peak / 1e9:.1f}", f"{100 * achieved / peak:.1f}%", f"{100 * achieved / theoretical:.1f}%"]
    return figures


def mfu_part(args: argparse.Namespace) -> tuple[ResultTable, list[str], dict[str, Any]]:
    shapes = [Shape.parse(s) for s in args.shapes]
    cfg = TrainConfig(micro_batch_tokens=args.micro_batch_tokens, lora_rank=16, lora_alpha=32)
    theoretical = theoretical_peak(args.clock_ghz)
    console.log(f"theoretical fp32 peak: {theoretical.derivation}")
    table = ResultTable(f"Trainer throughput, SmolLM2-135M fp32, {torch.get_num_threads()} threads; theoretical peak "
                        f"{theoretical.flops / 1e9:.1f} GFLOP/s",
                        ["mode", "shape", "trainable", "s/step", "tokens/s", "sampled tok/s", "GFLOP/s",
                         "GEMM peak GFLOP/s", "MFU vs GEMM", "MFU vs theoretical"], right_align_from=2)
    runs = []
    for lora in (False, True):
        for shape in shapes:
            figures = measure(lora, shape, args.steps, theoretical.flops, cfg)
            table.add(*figures.pop("row"))
            runs.append(figures)
    notes = [f"theoretical peak: {theoretical.derivation}",
             "GEMM peak: best fp32 matmul rate over 1024^3, 2048^3 and two model-shaped GEMMs, measured right "
             "before each row (the row's own figure).",
             "tokens/s counts every token of the batch (prompt and sampled); sampled tok/s only the trained ones.",
             "FLOP counts and the LoRA approximation are described in the script's docstring."]
    return table, notes, {"theoretical_peak": {"flops": theoretical.flops, "derivation": theoretical.derivation},
                          "runs": runs}


# ---------------------------------------------------------------- backends: local against FSDP2

ARMS = ["local", "fsdp-1", "fsdp-2"]
MODES = ["full", "lora"]


def run_one(arm: str, mode: str, shape: Shape, steps: int, micro: int) -> dict[str, Any]:
    """One arm in this process (`--one`): build the backend, step `steps + 1` times, report."""
    from tracetrain.trainer.backend import StepBatch, make_backend
    from tracetrain.trainer.memory import figures as memory_figures

    workers = 1 if arm == "local" else int(arm.split("-")[1])
    cfg = TrainConfig(backend="local" if arm == "local" else "fsdp", workers=workers, lora=mode == "lora",
                      lora_rank=16, lora_alpha=32, lr=1e-5 if mode == "full" else 2e-4, micro_batch_tokens=micro,
                      device="cpu")
    rng = random.Random(0)
    length = shape.prompt + shape.completion
    samples = [Sample(f"s{i}", f"g{i // 8}", [rng.randrange(10, 49000) for _ in range(length)],
                      [0] * shape.prompt + [1] * shape.completion, [0.0] * shape.prompt + [-1.0] * shape.completion,
                      [0] * length, rng.random()) for i in range(shape.batch)]
    advantages = [s.reward - 0.5 for s in samples]
    torch.manual_seed(0)
    started = time.perf_counter()
    backend = make_backend(cfg, smollm2_dir(), None)
    startup = time.perf_counter() - started
    rates, memory = [], []
    try:
        for step in range(steps + 1):  # the first step warms up; not counted
            figures = backend.step(StepBatch(samples, advantages))
            if step:
                rates.append(figures["tokens_per_second"])
            memory = figures["memory"]
            console.log(f"{arm} {mode}: step {step}/{steps} {figures['step_seconds']:.1f} s, "
                        f"{figures['tokens_per_second']:.0f} tok/s")
    finally:
        backend.close()
    if arm == "local":  # this process is the worker: its own figures, after the steps
        memory = [memory_figures(backend.model, backend.optimizer, "cpu")]  # type: ignore[attr-defined]
    return {"arm": arm, "mode": mode, "tokens_per_second": statistics.median(rates), "startup_s": startup,
            "memory": memory, "ray_s": figures.get("ray_s"), "workers_s": figures.get("workers_s"),
            "process_group_s": figures.get("process_group_s")}


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _spread(values: list[float], fmt: str = ".0f") -> str:
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.fmean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def backends_part(args: argparse.Namespace) -> tuple[ResultTable, list[str], dict[str, Any]]:
    """Every arm in a fresh process, so that peak memory is the arm's own."""
    plan = [(arm, mode) for mode in args.modes for arm in args.arms]
    runs = []
    for repeat in range(args.repeats):
        for arm, mode in plan[repeat % len(plan):] + plan[:repeat % len(plan)]:
            console.rule(f"repeat {repeat}: {arm} {mode}")
            out = subprocess.run([sys.executable, "-m", "bench.trainer_throughput", "--one", arm, mode,
                                  "--shape", args.shape, "--steps", str(args.steps),
                                  "--micro-batch-tokens", str(args.backend_micro_batch_tokens)],
                                 capture_output=True, text=True, check=False)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                console.print(out.stdout[-3000:], out.stderr[-3000:])
                raise SystemExit(f"{arm} {mode} failed ({out.returncode})")
            runs.append(json.loads(lines[-1].removeprefix("RESULT ")))
            console.log(f"{arm} {mode}: {runs[-1]['tokens_per_second']:.0f} tok/s")
    table = ResultTable(f"Backends, {Shape.parse(args.shape)} per step: mean (min-max) over repeats",
                        ["mode", "arm", "runs", "tokens/s", "params + optimizer per worker MiB", "vs local",
                         "peak RSS per worker MiB", "Ray start s", "workers ready s", "process group s"],
                        right_align_from=2)
    for mode in MODES:
        local = [sum(m["param_bytes"] + m["optimizer_bytes"] for m in r["memory"][:1])
                 for r in runs if r["arm"] == "local" and r["mode"] == mode]
        for arm in ARMS:
            mine = [r for r in runs if r["arm"] == arm and r["mode"] == mode]
            if not mine:
                continue
            state = max(m["param_bytes"] + m["optimizer_bytes"] for r in mine for m in r["memory"])
            peak = [m["peak_bytes"] / 2**20 for r in mine for m in r["memory"]]
            fsdp = arm != "local"
            table.add(mode, arm, len(mine), _spread([r["tokens_per_second"] for r in mine]), _mib(state),
                      f"{state / local[0]:.2f}x" if local else "-", _spread(peak),
                      _spread([r["ray_s"] for r in mine], ".1f") if fsdp else "-",
                      _spread([r["workers_s"] for r in mine], ".1f") if fsdp else "-",
                      _spread([r["process_group_s"] for r in mine], ".2f") if fsdp else "-")
    notes = ["params + optimizer: bytes of the tensors each worker holds (its FSDP shard), parameters trainable "
             "and frozen, AdamW moments; the largest worker's. LoRA's frozen base is sharded too.",
             "peak RSS: the worker process's peak resident memory (the bench process itself for local), imports "
             "and the Ray worker runtime included.",
             "Ray start: ray.init of a local Ray; workers ready: actor processes started, torch imported, the model "
             "built and sharded; process group: gloo rendezvous inside that.",
             f"{os.cpu_count()} cores: with fewer cores than the workers' steps would use, tokens/s cannot rise with "
             "workers."]
    return table, notes, {"runs": runs}


PARTS = {"mfu": "tokens/s and MFU of the trainer's step, full fine-tuning and LoRA",
         "backends": "the local backend against FSDP2 with 1 and 2 workers",
         "shared_prefix": "the demo's batches with `train.shared_prefix` off and on"}


def _as_part(name: str, run: Callable[[argparse.Namespace], tuple[ResultTable, list[str], dict[str, Any]]]
             ) -> PartRunner:
    def runner(args: argparse.Namespace, command: str) -> Part:
        started = run_started()
        table, notes, raw = run(args)
        return Part(name, command, provenance(started), [table], notes, raw)

    return runner


def main(argv: list[str] | None = None) -> None:
    parser = parts_parser("bench.trainer_throughput", __doc__, PARTS)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration, after one warm-up")
    parser.add_argument("--shapes", nargs="+", default=["32x48+16", "8x384+128"],
                        help="mfu: BxP+C, B sequences of P prompt and C sampled tokens")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048, help="mfu: the trainer's micro-batch budget")
    parser.add_argument("--clock-ghz", type=float, help="mfu: clock of the theoretical peak (see theoretical_peak)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS, help="backends: the arms")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES, help="backends: full, lora or both")
    parser.add_argument("--repeats", type=int, default=2, help="backends: rounds over the arms")
    parser.add_argument("--shape", default="16x48+16", help="backends: BxP+C of the one batch every arm steps on")
    parser.add_argument("--backend-micro-batch-tokens", type=int, default=1024,
                        help="backends: the micro-batch budget")
    shared_prefix.add_arguments(parser)
    parser.add_argument("--one", nargs=2, metavar=("ARM", "MODE"), help=argparse.SUPPRESS)
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    if args.one:
        figures = run_one(args.one[0], args.one[1], Shape.parse(args.shape), args.steps, args.micro_batch_tokens)
        print("RESULT " + json.dumps(figures))
        return
    run_parts("trainer_throughput", "Trainer throughput, MFU and backends", PARTS,
              {"mfu": _as_part("mfu", mfu_part), "backends": _as_part("backends", backends_part),
               "shared_prefix": shared_prefix.part}, args, command_line("bench.trainer_throughput", argv))


if __name__ == "__main__":
    main()
