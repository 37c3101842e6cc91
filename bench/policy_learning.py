"""The `learning` part of `bench.policies`: two named policies on one base model learn opposite rules.

Each seed runs `tracetrain demo --two-policies` exactly as a user runs it (its own vLLM, gateway, trainer and
two agent processes; the fixed held-out pairs of `tracetrain.demo.choices`). Policy `first` is rewarded for
naming the option asked first, policy `second` for the option asked second, on the same kind of questions.
The figure is each policy's greedy answers on the 64 held-out questions, before and after: the share naming
the first option, the second, or neither.

Fixed before the runs: a policy *learns its own rule* when its share naming its rewarded option is higher
after than before, and it *stays apart* when its share naming the other policy's option is not higher after
than before. Both, for both policies, on every seed.

The trainer settings are the demo's (tracetrain/demo/run.py `DEMO_TRAINING`, chosen for the arithmetic
task), with each version published as its own adapter; nothing was tuned on this task's held-out pairs.
Each agent's budget is an episode count (`--episodes`), not minutes, so a loaded machine slows the run but
does not change what it trains on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, Part, ResultTable, console, provenance, run_started, utc_text

POLICIES = {"first": "second", "second": "first"}
"""Each policy and the other policy's rewarded option."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="learning: the demo's seeds")
    parser.add_argument("--episodes", type=int, default=256, help="learning: each agent's episode budget per seed")
    parser.add_argument("--keep-runs", action="store_true",
                        help="learning: a seed whose run with the same budget finished under bench/out is "
                             "reported again instead of re-run (a run stopped half-way loses no finished seed)")


def part(args: argparse.Namespace, command: str) -> Part:
    """Every seed's run (or the finished one kept, with `--keep-runs`), and the tables."""
    started = run_started()
    runs, kept = [], []
    for seed in args.seeds:
        out = OUT_DIR / "policies-learning" / f"seed-{seed}"
        done = out / "summary.json"
        if args.keep_runs and done.exists() and json.loads(done.read_text()).get("agent_args") == \
                ["--episodes", str(args.episodes)]:
            console.log(f"seed {seed}: kept the finished run in {out}")
            runs.append(json.loads(done.read_text()))
            kept.append(f"seed {seed} finished {utc_text(datetime.fromtimestamp(done.stat().st_mtime, UTC))}")
        else:
            runs.append(run_seed(seed, args.episodes, out))
    tables, notes = report(runs)
    if kept:
        notes.append(f"runs kept from earlier (`--keep-runs`; the provenance line is this report's): {', '.join(kept)}")
    return Part("learning", command, provenance(started), tables, notes, {"runs": runs, "kept": kept})


def run_seed(seed: int, episodes: int, out: Path) -> dict[str, Any]:
    """One `tracetrain demo --two-policies` run; its summary."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "tracetrain.cli", "demo", "--two-policies", "--seed", str(seed),
               "--minutes", "120", "--agent-args", f"--episodes {episodes}", "--out", str(out)]
    console.log(f"seed {seed}: {' '.join(command[2:])}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.log").open("wb") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    for policy in POLICIES:
        console.log(f"seed {seed}: policy {policy} names its option {summary['before'][policy][policy]:.1%} -> "
                    f"{summary['after'][policy][policy]:.1%} of held-out questions")
    return summary


def verdict(run: dict[str, Any], policy: str) -> tuple[bool, bool]:
    """(learned its own rule, stayed apart from the other's) for one policy in one run: the criteria above."""
    own, other = policy, POLICIES[policy]
    before, after = run["before"][policy], run["after"][policy]
    return after[own] > before[own], after[other] <= before[other]


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.1%} ({min(values):.1%}–{max(values):.1%})"


def report(runs: list[dict[str, Any]]) -> tuple[list[ResultTable], list[str]]:
    """The per-seed table, the summary over seeds and the notes."""
    per_seed = ResultTable("per seed and policy: share of the 64 held-out questions (greedy) naming each option",
                           ["seed", "policy (rewarded for)", "first option before → after",
                            "second option before → after", "neither before → after", "version after",
                            "learned its rule", "stayed apart"], right_align_from=2)
    for run in runs:
        for policy in POLICIES:
            before, after = run["before"][policy], run["after"][policy]
            learned, apart = verdict(run, policy)
            per_seed.add(run["seed"], f"{policy} ({policy} option)",
                         *(f"{before[k]:.1%} → {after[k]:.1%}" for k in ("first", "second", "other")),
                         max(after["versions"]), "yes" if learned else "no", "yes" if apart else "no")
    summary = ResultTable(f"over {len(runs)} seeds: mean (min–max)", ["policy", "names its own option before",
                                                                      "after", "names the other's option before",
                                                                      "after", "seeds meeting both criteria"])
    for policy, other in POLICIES.items():
        summary.add(policy, _spread([r["before"][policy][policy] for r in runs]),
                    _spread([r["after"][policy][policy] for r in runs]),
                    _spread([r["before"][policy][other] for r in runs]),
                    _spread([r["after"][policy][other] for r in runs]),
                    f"{sum(all(verdict(r, policy)) for r in runs)} of {len(runs)}")
    budget = runs[0].get("agent_args", [])
    notes = [
        "task: tracetrain/demo/choices.py, 'Which do you prefer, X or Y?' with X and Y from one category; held-out "
        "pairs are never asked in training, in either order (tests/unit/test_demo_choices.py)",
        f"each seed: `tracetrain demo --two-policies --seed N --agent-args '{' '.join(budget)}'` (each agent's "
        "episode budget), the demo's trainer settings, vLLM on CPU serving both policies' adapters",
        "criteria, fixed before the runs: learned = its own option's share higher after than before; apart = the "
        "other policy's option's share not higher after than before",
        "both policies start from the same base model, so their 'before' rows are the same answers",
    ]
    return [summary, per_seed], notes
