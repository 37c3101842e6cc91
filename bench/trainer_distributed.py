"""The trainer's backends on this machine: `local` vs `fsdp` with 1 and 2 workers, SmolLM2-135M, full
fine-tuning and LoRA r16, float32.

    python -m bench.trainer_distributed                      # about 10-15 minutes on a 2-core CPU
    python -m bench.trainer_distributed --repeats 1 --steps 2 --arms fsdp-2

Per arm: training tokens/s (median of the measured steps; the first step warms up and is dropped),
parameter + optimizer bytes per worker (each worker's own shard: the figure FSDP exists to shrink; the
issue's target is <= 0.6x of local at 2 workers), each worker's peak resident memory, and for fsdp the
start-up: Ray, the workers (process start, imports, model build, sharding) and the process group.

Every arm runs in a fresh process (so peak memory is the arm's own), on the same synthetic batch
(B sequences of P prompt + C sampled tokens, seed 0), the same optimizer settings and micro-batch
budget; arms are interleaved and the whole set repeated `--repeats` times, the order rotated.
On 2 cores throughput cannot scale with workers: two workers share the two cores a local step uses.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ResultTable, console, write_results

ARMS = ["local", "fsdp-1", "fsdp-2"]
MODES = ["full", "lora"]


def run_one(arm: str, mode: str, shape: tuple[int, int, int], steps: int, micro: int) -> dict[str, Any]:
    """One arm in this process: build the backend, step `steps + 1` times, report."""
    import torch

    from tracetrain.config import TrainConfig
    from tracetrain.engines.models import smollm2_dir
    from tracetrain.trainer.backend import StepBatch, make_backend
    from tracetrain.trainer.data import Sample
    from tracetrain.trainer.memory import figures as memory_figures

    batch, prompt, completion = shape
    workers = 1 if arm == "local" else int(arm.split("-")[1])
    cfg = TrainConfig(backend="local" if arm == "local" else "fsdp", workers=workers, lora=mode == "lora",
                      lora_rank=16, lora_alpha=32, lr=1e-5 if mode == "full" else 2e-4, micro_batch_tokens=micro,
                      device="cpu")
    rng = random.Random(0)
    samples = [Sample(f"s{i}", f"g{i // 8}", [rng.randrange(10, 49000) for _ in range(prompt + completion)],
                      [0] * prompt + [1] * completion, [0.0] * prompt + [-1.0] * completion,
                      [0] * (prompt + completion), rng.random()) for i in range(batch)]
    advantages = [s.reward - 0.5 for s in samples]
    torch.manual_seed(0)
    started = time.perf_counter()
    backend = make_backend(cfg, smollm2_dir(), None)
    startup = time.perf_counter() - started
    rates, memory = [], []
    try:
        for step in range(steps + 1):
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


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def spread(values: list[float], fmt: str = ".0f") -> str:
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.fmean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def report(runs: list[dict[str, Any]], command: str) -> Path:
    table = ResultTable("per arm: mean (min-max) over repeats",
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
            table.add(mode, arm, len(mine), spread([r["tokens_per_second"] for r in mine]), mib(state),
                      f"{state / local[0]:.2f}x" if local else "-", spread(peak),
                      spread([r["ray_s"] for r in mine], ".1f") if fsdp else "-",
                      spread([r["workers_s"] for r in mine], ".1f") if fsdp else "-",
                      spread([r["process_group_s"] for r in mine], ".2f") if fsdp else "-")
    console.print(table.rich())
    notes = ["params + optimizer: bytes of the tensors each worker holds (its FSDP shard), parameters trainable "
             "and frozen, AdamW moments; the largest worker's. LoRA's frozen base is sharded too.",
             "peak RSS: the worker process's peak resident memory (the bench process itself for local), imports "
             "and the Ray worker runtime included.",
             "Ray start: ray.init of a local Ray; workers ready: actor processes started, torch imported, the model "
             "built and sharded; process group: gloo rendezvous inside that.",
             "2 cores: the fsdp arms' two workers get one core each, where local's step uses both, so tokens/s "
             "cannot rise with workers here."]
    return write_results("trainer_distributed", "Trainer backends: local vs FSDP2", command, [table], notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per arm, after one warm-up step")
    parser.add_argument("--shape", default="16x48+16", help="BxP+C: B sequences of P prompt and C sampled tokens")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--one", nargs=2, metavar=("ARM", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    b, rest = args.shape.split("x")
    p, c = rest.split("+")
    shape = (int(b), int(p), int(c))
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], args.one[1], shape, args.steps, args.micro_batch_tokens)))
        return
    plan = [(arm, mode) for mode in args.modes for arm in args.arms]
    runs = []
    for repeat in range(args.repeats):
        order = plan[repeat % len(plan):] + plan[:repeat % len(plan)]
        for arm, mode in order:
            console.rule(f"repeat {repeat}: {arm} {mode}")
            out = subprocess.run([sys.executable, "-m", "bench.trainer_distributed", "--one", arm, mode,
                                  "--shape", args.shape, "--steps", str(args.steps),
                                  "--micro-batch-tokens", str(args.micro_batch_tokens)],
                                 capture_output=True, text=True, check=False)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                console.print(out.stdout[-3000:], out.stderr[-3000:])
                raise SystemExit(f"{arm} {mode} failed ({out.returncode})")
            runs.append(json.loads(lines[-1].removeprefix("RESULT ")))
            console.log(f"{arm} {mode}: {runs[-1]['tokens_per_second']:.0f} tok/s")
    command = "python -m bench.trainer_distributed " + " ".join(sys.argv[1:])
    console.log(f"wrote {report(runs, command.strip())}")


if __name__ == "__main__":
    main()
