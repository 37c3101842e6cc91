"""The demo over several seeds: held-out reward before and after, versions per minute, and the held-out
reward of every policy version along the way (does learning ever fall back?).

    python -m bench.demo_seeds --seeds 0 1 2
    python -m bench.demo_seeds --seeds 0 --minutes 2 --results-dir /tmp/demo_seeds      # smoke

Each seed runs `tracetrain demo --seed N` exactly as a user runs it (its own vLLM, gateway, trainer and
agent processes; the fixed held-out test set of `tracetrain.demo.arithmetic`), keeping every checkpoint.
Afterwards every `--every`-th version's merged weights are scored on the same held-out sums with HF
`generate`, greedy, `MAX_TOKENS` answer tokens: the curve the training reward per version cannot give,
since each version serves only a handful of training problems (its mean moves with which ones were
drawn). The demo's own before/after figures (through vLLM) are the headline; the per-version curve is
the check. Results: `bench/results/demo_seeds.{md,json,png}`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import demo_choice as choice
from bench.common import (
    OUT_DIR,
    RESULTS_DIR,
    ResultTable,
    RunStart,
    add_results_dir_argument,
    command_line,
    console,
    provenance,
    run_started,
    write_results,
)

NAME = "demo_seeds"


def run_seed(seed: int, args: argparse.Namespace, argv: list[str] | None, settings: list[str],
             split: str) -> dict[str, Any]:
    """One demo run and its per-version curve on `split`; the merged checkpoints are deleted after."""
    out = OUT_DIR / NAME / f"seed{seed}"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = run_demo(seed, args.minutes, out, settings, split)
    summary["curve"] = {str(k): v for k, v in version_curve(out / "checkpoints", args.every, split).items()}
    summary["training_reward"] = _training_reward(out / "episodes.jsonl")
    summary["command"] = command_line("bench.demo_seeds", argv)  # for --from-json
    shutil.rmtree(out / "checkpoints")  # full merged weights per version: the disk would fill
    return summary


def run_demo(seed: int, minutes: float, out: Path, settings: list[str], split: str = "test") -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "tracetrain.cli", "demo", "--seed", str(seed), "--minutes", str(minutes),
               "--out", str(out), "--eval-split", split, "--set", "keep_checkpoints=100000",
               *(f"--set={s}" for s in settings)]
    console.log(f"seed {seed}: {' '.join(command[2:])}")
    with (out.parent / f"{out.name}.log").open("wb") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    before, after = summary["before"]["mean_reward"], summary["after"]["mean_reward"]
    console.log(f"seed {seed}: held-out {before:.3f} -> {after:.3f}, "
                f"{summary['versions']} versions ({summary['versions_per_minute']:.2f}/min)")
    return summary


def version_curve(checkpoints: Path, every: int, split: str = "test") -> dict[int, float]:
    """Held-out mean reward of versions 0, every, 2*every, ... and the last one (HF generate, greedy), on every
    problem of `split`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracetrain.demo import arithmetic
    from tracetrain.engines.models import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    problems = arithmetic.held_out(len({"test": arithmetic.TEST, "validation": arithmetic.VALIDATION}[split]), split)
    texts = [tokenizer.apply_chat_template(arithmetic.messages(q), add_generation_prompt=True, tokenize=False)
             for q, _ in problems]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    versions = sorted(int(p.name[1:]) for p in checkpoints.glob("v[0-9]*") if (p / "merged").is_dir())
    chosen = sorted({0, *versions[every - 1 :: every], *versions[-1:]})
    curve: dict[int, float] = {}
    for version in chosen:
        path = smollm2_dir() if version == 0 else checkpoints / f"v{version:06d}" / "merged"
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=arithmetic.MAX_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        replies = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        curve[version] = statistics.fmean(arithmetic.score(r, a) for r, (_, a) in zip(replies, problems, strict=True))
        console.log(f"  version {version}: {split} {curve[version]:.3f}")
    return curve


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def report(args: argparse.Namespace, runs: list[dict[str, Any]], started: RunStart,
           info: dict[str, Any] | None = None) -> Path:
    per_seed = ResultTable("per seed (held-out: the demo's own greedy evaluation through vLLM, 64 test sums)",
                           ["seed", "held-out before", "after", "exact before", "exact after", "versions",
                            "versions/min", "distinct replies before/after", "lowest version after v0 (HF, 96 sums)",
                            "largest fall from the best so far"])
    for run in runs:
        curve = {int(k): v for k, v in run["curve"].items()}
        points = [curve[v] for v in sorted(curve)]
        falls = [max(points[: i + 1]) - point for i, point in enumerate(points)]
        per_seed.add(run["seed"], f"{run['before']['mean_reward']:.3f}", f"{run['after']['mean_reward']:.3f}",
                     f"{run['before']['exact']:.1%}", f"{run['after']['exact']:.1%}", run["versions"],
                     f"{run['versions_per_minute']:.2f}",
                     f"{run['before'].get('distinct_replies', '?')}/{run['after'].get('distinct_replies', '?')}",
                     f"{min(points[1:], default=points[0]):.3f}",
                     f"{max([0.0, *falls]):.3f}")
    summary = ResultTable(f"over {len(runs)} seeds: mean (min–max)", ["figure", "value"])
    summary.add("held-out reward before", _spread([r["before"]["mean_reward"] for r in runs]))
    summary.add("held-out reward after", _spread([r["after"]["mean_reward"] for r in runs]))
    summary.add("exact answers before", _spread([100 * r["before"]["exact"] for r in runs], "{:.1f}%"))
    summary.add("exact answers after", _spread([100 * r["after"]["exact"] for r in runs], "{:.1f}%"))
    summary.add("policy versions", _spread([float(r["versions"]) for r in runs], "{:.0f}"))
    summary.add("versions per minute", _spread([r["versions_per_minute"] for r in runs], "{:.2f}"))
    worst = min(runs, key=lambda r: r["after"]["mean_reward"] - r["before"]["mean_reward"])
    summary.add("worst seed", f"seed {worst['seed']}: {worst['before']['mean_reward']:.3f} -> "
                              f"{worst['after']['mean_reward']:.3f}")
    improved = sum(r["after"]["mean_reward"] > r["before"]["mean_reward"] for r in runs)
    curves = ResultTable("held-out reward per policy version (HF generate, greedy, all 96 test sums)",
                         ["seed", "version: reward"])
    for run in runs:
        curves.add(run["seed"], ", ".join(f"{k}: {v:.3f}" for k, v in sorted((int(k), v) for k, v in
                                                                            run["curve"].items())))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    plot = args.results_dir / f"{NAME}.png"
    _plot(runs, plot)
    notes = [f"held-out after > before on {improved} of {len(runs)} seeds",
             f"each seed: `tracetrain demo --seed N --minutes {args.minutes:g}` with the demo's trainer settings "
             f"(tracetrain/demo/run.py DEMO_TRAINING){', and ' + ', '.join(args.set) if args.set else ''}, every "
             "checkpoint kept for the per-version curve",
             "distinct replies: how many different answers the 64 greedy held-out replies hold (64 different sums "
             "have 36 different answers); a handful means the policy answers the same numbers whatever the question",
             "held-out sums: the fixed test split of tracetrain/demo/arithmetic.py, disjoint from every training "
             "pair in either order by construction (tests/unit/test_demo_split.py)",
             f"per-version curve: every {args.every}. version and the last, scored offline; HF generate and vLLM "
             "differ slightly in numerics, so its end point need not equal the demo's own 'after'",
             f"plot: `{plot.name}`"]
    command = runs[0].get("command") or command_line("bench.demo_seeds")
    return write_results(NAME, "The demo over seeds", command, [summary, per_seed, curves], notes, raw={"runs": runs},
                         started=started, results_dir=args.results_dir, info=info)


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        curve = sorted((int(k), v) for k, v in run["curve"].items())
        left.plot([k for k, _ in curve], [v for _, v in curve], marker="o", label=f"seed {run['seed']}")
        trained = run["training_reward"]
        right.plot([int(k) for k in trained], list(trained.values()), alpha=0.7, label=f"seed {run['seed']}")
    left.set_xlabel("policy version")
    left.set_ylabel("held-out reward (96 test sums, greedy)")
    left.set_title("held-out reward of each version")
    right.set_xlabel("policy version")
    right.set_ylabel("training reward (episodes served by that version)")
    right.set_title("training reward per version (a handful of problems each)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("tracetrain demo over seeds: SmolLM2-135M-Instruct learning arithmetic (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _training_reward(episodes: Path) -> dict[str, float]:
    by_version: dict[int, list[float]] = {}
    for line in episodes.read_text().splitlines():
        episode = json.loads(line)
        by_version.setdefault(int(episode["version"]), []).append(float(episode["reward"]))
    return {str(v): statistics.fmean(rs) for v, rs in sorted(by_version.items())}


def rerender(args: argparse.Namespace) -> Path:
    """`--from-json`: the report again from the results' JSON, keeping the provenance of the runs it holds
    (a JSON from before provenance was recorded is a bare list of runs, and says so)."""
    document = json.loads((RESULTS_DIR / f"{NAME}.json").read_text())
    started = run_started()
    if isinstance(document, list):
        info = {**provenance(started), "note": "re-rendered with --from-json from runs whose provenance was not "
                                               "recorded; git, machine and times here are the re-render's"}
        return report(args, document, started, info)
    return report(args, document["raw"]["runs"], started, document["provenance"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.demo_seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=10.0, help="the demo's --minutes (its default)")
    parser.add_argument("--every", type=int, default=2, help="score every N-th version's checkpoint")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="trainer setting passed to every demo run (repeatable)")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="choose settings on the validation split: every combination of these values, each over "
                             "--seeds, scored by the rule in bench/demo_choice.py; writes demo_choice.{md,json}")
    parser.add_argument("--from-json", action="store_true",
                        help="only write the report again from bench/results/demo_seeds.json (with --grid: "
                             "demo_choice.json, under the current rule)")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    if args.from_json:
        console.print(f"results: {choice.rerender(args) if args.grid else rerender(args)}")
        return
    started = run_started()
    if args.grid:
        console.print(f"results: {choice.choose(args, argv, run_seed, started)}")
        return
    runs = [run_seed(seed, args, argv, args.set, "test") for seed in args.seeds]
    console.print(f"results: {report(args, runs, started)}")


if __name__ == "__main__":
    main()
