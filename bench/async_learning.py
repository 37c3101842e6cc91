"""Synchronous vs asynchronous learning on the demo task, with and without staleness-aware admission,
and `serve --train` with no training configuration at all: what each learns in the same time, and how
much of what the agents generated the trainer actually learned from.

Arms (tracetrain + vLLM, the demo's engine and agent, groups of 8, temperature 1; everything else equal):

- `sync`: the demo's settings (`DEMO_TRAINING`): generation waits while a batch trains.
- `async-admission`: the same with `mode: async` and `admission: staleness` (one batch may be ready or
  running while one trains).
- `async-none`: `mode: async`, `admission: none` (organic traffic: the trainer takes the freshest).
- `defaults`: `serve --train` with an empty `train:` section (only the checkpoint directory and seed) and
  no `admission` setting: whatever `TrainConfig()` and `admission: auto` give.

Metrics, fixed before any run: time to held-out reward `THRESHOLD` (the learning-speed bench's 0.55, on
the same 96 test sums), held-out reward at `AT_MINUTES`, versions per minute, and the share of the
episodes the agent finished that a step learned from (`trained share`; the issue's target: 90% with
admission), with the rest by reason (stale, zero-variance, still ready or running at the end). With
`--drain-s`, the share is also measured after a drain: agents stopped at the budget, the trainer goes on
until fewer than a batch is ready, so the work in flight at the cutoff is counted by its real fate.

For seed k the arms run in an order rotated by k, one at a time, each with its own wall-clock budget
counted from before its processes start.

    python -m bench.async_learning --seeds 0 1 2 --minutes 7
    python -m bench.async_learning --seeds 0 --minutes 2 --arms async-admission --output async_learning_smoke

Results: `bench/results/<output>.{md,png,json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from bench.common import OUT_DIR, RESULTS_DIR, ResultTable, console, free_port, machine_line, write_results
from bench.learning_speed import THRESHOLD, RunSpec, _arm_clock, rotated, run_gateway
from bench.learning_speed_report import ArmRun, Spread, reward_at, steps_per_minute, time_to
from tracetrain.config import TrainConfig
from tracetrain.demo import arithmetic
from tracetrain.demo.run import DEMO_TRAINING

ARMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sync": (DEMO_TRAINING, {}),
    "async-admission": ({**DEMO_TRAINING, "mode": "async"}, {"admission": "staleness"}),
    "async-none": ({**DEMO_TRAINING, "mode": "async"}, {"admission": "none"}),
    "defaults": ({}, {}),
}
"""(train settings, gateway settings) per arm."""
AT_MINUTES = (3.0, 5.0, 7.0)
"""Held-out reward is reported at these times (from the arm's start, start-up included)."""


def write_config(out: Path, port: int, seed: int, train: dict[str, Any], gateway: dict[str, Any]) -> Path:
    config = {"port": port, "vllm_port": free_port(), "engine": "vllm", "log_level": "INFO",
              "db_url": f"sqlite:///{(out / 'store.db').resolve()}", **gateway,
              "train": {**train, "seed": seed, "checkpoint_dir": str((out / "checkpoints").resolve())}}
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_arm(arm: str, seed: int, order: int, args: argparse.Namespace) -> ArmRun:
    out = OUT_DIR / "async_learning" / args.output / f"{arm}-s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    clock = _arm_clock()
    train, gateway = ARMS[arm]
    port = free_port()
    config = write_config(out, port, seed, train, gateway)
    lr = float(train.get("lr", TrainConfig().lr))
    spec = RunSpec(arm, seed, lr, args.minutes, args.eval_every, args.eval_size, "test", order)
    load = os.getloadavg()[0]
    batch = int(train.get("batch_sessions", TrainConfig().batch_sessions))
    run = run_gateway(spec, arm, config, port, out, clock, drain_s=args.drain_s, batch_sessions=batch)
    run.load = load
    return run


def trained_share(run: ArmRun) -> float:
    return run.trained_sessions / run.episodes if run.episodes else 0.0


def drained_share(run: ArmRun) -> float | None:
    if run.trained_after_drain is None or not run.episodes:
        return None
    return run.trained_after_drain / run.episodes


def summary(runs: list[ArmRun], arms: list[str], threshold: float) -> ResultTable:
    table = ResultTable("per arm: mean (min-max) over seeds",
                        ["arm", "seeds", f"min to {threshold:g}", "reached",
                         *[f"held-out @{m:g} min" for m in AT_MINUTES], "final held-out", "versions/min",
                         "episodes", "trained share", "after drain", "set aside (stale / zero-var.)",
                         "staleness 0/1/2+ %"])
    for arm in arms:
        mine = [r for r in runs if r.arm == arm]
        if not mine:
            continue
        times = [time_to(r, threshold) for r in mine]

        def cell(values: list[float], fmt: str = ".3f") -> str:
            s = Spread.of(values)
            return f"{s.mean:{fmt}} ({s.low:{fmt}}-{s.high:{fmt}})"

        stale = statistics.fmean(r.set_aside.get("stale", 0) for r in mine)
        flat = statistics.fmean(r.set_aside.get("zero_variance", 0) for r in mine)
        ages: dict[str, int] = {}
        for r in mine:
            for k, n in r.staleness.items():
                key = k if int(k) < 2 else "2+"
                ages[key] = ages.get(key, 0) + n
        total = sum(ages.values()) or 1
        # not reached counts as the budget in the mean, as in the learning-speed bench
        reach = [(t if t is not None else r.budget_s) / 60 for t, r in zip(times, mine, strict=True)]
        drained = [100 * d for r in mine if (d := drained_share(r)) is not None]
        table.add(arm, len(mine), cell(reach, ".2f"),
                  f"{sum(t is not None for t in times)}/{len(mine)}",
                  *[cell([reward_at(r, m * 60) for r in mine]) for m in AT_MINUTES],
                  cell([r.points[-1].reward for r in mine]), cell([steps_per_minute(r) for r in mine], ".2f"),
                  cell([float(r.episodes) for r in mine], ".0f"), cell([100 * trained_share(r) for r in mine], ".1f")
                  + " %", cell(drained, ".1f") + " %" if drained else "-", f"{stale:.0f} / {flat:.0f}",
                  " / ".join(f"{100 * ages.get(k, 0) / total:.0f}" for k in ("0", "1", "2+")))
    return table


def runs_table(runs: list[ArmRun], threshold: float) -> ResultTable:
    table = ResultTable("every run (order: position among its seed's arms, 0 = first)",
                        ["arm", "seed", "order", "load avg", "start-up s", "versions", f"min to {threshold:g}",
                         "first eval", "final eval", "episodes", "trained", "set aside", "samples/step",
                         "drain s", "trained after drain", "set aside after", "ready after"])
    for r in sorted(runs, key=lambda r: (r.seed, r.order)):
        reached = time_to(r, threshold)
        table.add(r.arm, r.seed, r.order, f"{r.load:.1f}", f"{r.startup_s:.0f}", r.steps,
                  f"{reached / 60:.2f}" if reached is not None else "not reached", f"{r.points[0].reward:.3f}",
                  f"{r.points[-1].reward:.3f}", r.episodes, r.trained_sessions, json.dumps(r.set_aside),
                  f"{r.samples_per_step:.1f}" if r.samples_per_step else "-",
                  *((f"{r.drain_s:.0f}", r.trained_after_drain, json.dumps(r.set_aside_after_drain),
                     r.ready_after_drain) if r.drain_s is not None else ("-", "-", "-", "-")))
    return table


def plot(path: Path, runs: list[ArmRun], arms: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = dict(zip(arms, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for r in runs:
        ax.step([p.t / 60 for p in r.points], [p.reward for p in r.points], where="post", color=colors[r.arm],
                alpha=0.8, label=r.arm if r.seed == min(x.seed for x in runs if x.arm == r.arm) else None)
    ax.axhline(THRESHOLD, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("minutes since the arm started (start-up included)")
    ax.set_ylabel(f"held-out reward ({len(arithmetic.TEST)} test sums, greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.async_learning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget per run, start-up included")
    parser.add_argument("--eval-every", type=float, default=90.0)
    parser.add_argument("--eval-size", type=int, default=len(arithmetic.TEST))
    parser.add_argument("--drain-s", type=float, default=0.0,
                        help="after the budget, let the trainer consume what the stopped agents finished, up to this "
                             "long (0: no drain)")
    parser.add_argument("--output", default="async_learning")
    parser.add_argument("--from-json", action="store_true", help="re-render the report from its JSON only")
    args = parser.parse_args(argv)
    raw_path = RESULTS_DIR / f"{args.output}.json"
    if args.from_json:
        raw = json.loads(raw_path.read_text())
        runs = [ArmRun.from_json(r) for r in raw["runs"]]
    else:
        runs, failed = [], []
        for k, seed in enumerate(args.seeds):
            for order, arm in enumerate(rotated(list(args.arms), k)):
                console.rule(f"{arm}, seed {seed}, {args.minutes:g} min")
                try:
                    runs.append(run_arm(arm, seed, order, args))
                except (Exception, SystemExit) as exc:  # one broken run must not lose the others; reported
                    console.log(f"[red]{arm} seed {seed} failed: {exc}")
                    failed.append(f"{arm} seed {seed}: {type(exc).__name__}: {str(exc)[:300]}")
        command = " ".join(["python -m bench.async_learning", *sys.argv[1:]])
        raw = {"failed": failed, "args": vars(args), "machine": machine_line(), "command": command,
               "threshold": THRESHOLD, "arms": {a: {"train": t, "gateway": g} for a, (t, g) in ARMS.items()},
               "runs": [asdict(r) for r in runs]}
        raw_path.write_text(json.dumps(raw, indent=1))
    arms = [a for a in ARMS if any(r.arm == a for r in runs)]
    plot(RESULTS_DIR / f"{args.output}.png", runs, arms)
    notes = [f"held-out: the {args.eval_size} first test sums of tracetrain.demo.arithmetic (disjoint from training by "
             f"construction), greedy, every {args.eval_every:g} s",
             "trained share = sessions a step learned from / episodes the agent finished; the rest is set aside in the "
             "store by reason (stale, zero_variance, no_samples) or still ready/running when the budget ended",
             "after drain (runs with --drain-s): the same share once the trainer, with the agents stopped at the "
             "budget, took what they had finished: until the ready and claimed sessions made less than a batch for "
             "10 s, or the drain's limit; every figure before this column is measured at the budget, before the "
             "drain",
             f"arms' settings: {json.dumps(raw['arms'])}",
             *[f"FAILED run, not in the tables: {f}" for f in raw.get("failed", [])]]
    write_results(args.output, "Sync vs async learning, with and without admission", raw.get("command", ""),
                  [summary(runs, arms, THRESHOLD), runs_table(runs, THRESHOLD)], notes)


if __name__ == "__main__":
    main()
