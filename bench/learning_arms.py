"""Learning from traffic as production agents send it (issue 31): the same task, settings, episode
budget and held-out evaluation, with the traffic shaped differently in each arm.

    python -m bench.learning_arms                                   # every arm, seeds 0 1 2
    python -m bench.learning_arms --arms grouped singletons --seeds 0 --episodes 64 \\
        --results-dir /tmp/learning_arms                            # smoke
    python -m bench.learning_arms --seeds 1 --keep                  # seed 1 added to the current file

Each (seed, arm) runs `tracetrain demo --seed N` exactly as a user runs it (its own vLLM, gateway,
trainer and agent processes, the demo's trainer settings), with the arm's agent flags (see
`tracetrain.demo.arithmetic`) and trainer settings, until the agent has sent `--episodes` episodes. The
demo's greedy held-out evaluation on the fixed test sums, before and after, is the figure; the
untrained model is every run's "before". For seed k the order of the arms is rotated by k, so no arm
always runs first on a cold machine.

Arms (each changes one thing from `grouped`, today's demo traffic):
- `grouped`: 8 attempts per problem in one group, every reward at once;
- `singletons`: one attempt per problem, no group named (the gateway groups repeats of a prompt);
- `late`: rewards 30-300 s after their episode, out of order; `late+staleness16` trains on sessions up
  to 16 versions old (`train.max_staleness`), the bound chosen on the validation split over 4 and 1;
- `sparse`: only 25% of episodes ever rewarded;
- `noisy`: 20% of rewards flipped;
- `hard`: only an exact answer pays, so most groups of the base model fail together; `hard+baseline`
  trains those all-equal groups against the running baseline (`train.flat_groups=baseline`) instead of
  setting them aside, and `hard+singletons` sends it one attempt at a time; `hard+baseline+replay` also
  trains each step on up to 8 earlier successes again (self-imitation, `train.replay_successes`),
  chosen on the validation split over `hard`, `hard+baseline` and `hard+replay` (replay alone);
  `hard+defaults` runs the trainer with `serve --train`'s defaults instead of the demo's settings, as a
  new user would, and `hard+defaults+set-aside` sets all-equal groups aside instead (run only when named:
  on the validation split they made `train.flat_groups: baseline` the default);
- `grouped+disk` and `grouped+overlap`: the demo's traffic with the trainer's publish changed, to show
  where a step's time goes: through disk (how full weights were published before they went from memory),
  and in `async` mode with each publish on a thread of its own while the next step trains
  (`train.publish_overlap`); `grouped+fast-vllm` with vLLM on the CPU set for speed instead of its own
  defaults: 32-token KV-cache blocks, so the shared beginning of the demo's prompts comes from the prefix
  cache (under 128 none does), and every core for generation (`engine.block_size`, `engine.cpu_cores`);
- `multi-turn`: another task and agent (`tracetrain demo --agent tools`): a LangChain agent adds three
  numbers with an `add` tool over three turns, rewarded once at the end (tracetrain/demo/tool_agent.py);
  its held-out set is its own, so compare its gain, not its level, with the others. `multi-turn-2` adds
  two numbers in two turns; the `-correct` variants pay only a right first number, no partial credit.
  Which of them is the multi-turn arm was chosen on the validation split (`learning_arms_validation.md`,
  seed 100) by a rule fixed before the last candidate ran: the candidate with the most tool turns whose
  held-out share of right answers (the first number is the total, whatever the reward paid) rose by at
  least 0.10; more turns first, because credit then has further to travel. It chose `multi-turn-2-correct`
  (right answers 26.6% → 98.4%); three numbers with partial credit rose in reward (0.246 → 0.379) by
  getting closer, not right (6.2% → 3.1%), and paid only when right, no group of 8 ever differed.

Per arm: held-out before and after (mean and min-max over seeds), episodes generated and rewarded,
the share of generated episodes the trainer trained on, and what it set aside by reason. Results:
`bench/results/learning_arms.{md,json,png}`. The held-out metric (mean reward on 64 test sums, greedy)
is fixed before any run; no setting here was chosen on the test split. `--eval-split validation` runs the
same on the validation split, into `learning_arms_validation.*`: how the multi-turn task was chosen.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from bench.common import (
    OUT_DIR,
    ResultTable,
    RunStart,
    add_results_dir_argument,
    command_line,
    console,
    provenance,
    run_started,
    write_results,
)
from tracetrain.config import TrainConfig
from tracetrain.demo.run import DEMO_TRAINING

NAME = "learning_arms"


@dataclass(frozen=True)
class Arm:
    label: str
    agent: tuple[str, ...] = ()
    """Flags for the demo agent on top of the episode budget."""
    train: tuple[str, ...] = ()
    """`--set` values: the trainer's settings, or the engine's."""
    demo: tuple[str, ...] = ()
    """Flags for `tracetrain demo` itself (which agent runs)."""


_DEFAULTS = TrainConfig()
SERVE_DEFAULTS = tuple(f"train.{key}={json.dumps(getattr(_DEFAULTS, key))}"
                       for key, value in DEMO_TRAINING.items() if getattr(_DEFAULTS, key) != value)
"""`--set` values that undo the demo's trainer settings where they differ from `TrainConfig`'s defaults,
so the trainer runs as `serve --train` does for a user who set nothing."""

ARMS = {
    "grouped": Arm("8 attempts per problem, rewards at once (the demo)"),
    "singletons": Arm("one attempt per problem, no group named", ("--group-size", "1", "--no-group")),
    "late": Arm("rewards 30-300 s late, out of order", ("--reward-delay", "30", "300")),
    "late+staleness4": Arm("rewards 30-300 s late, out of order; sessions up to 4 versions old trained on",
                           ("--reward-delay", "30", "300"), ("train.max_staleness=4",)),
    "late+staleness16": Arm("rewards 30-300 s late, out of order; sessions up to 16 versions old trained on",
                            ("--reward-delay", "30", "300"), ("train.max_staleness=16",)),
    "sparse": Arm("25% of episodes rewarded", ("--reward-share", "0.25")),
    "noisy": Arm("20% of rewards flipped", ("--reward-flip", "0.2")),
    "hard": Arm("exact answers only", ("--reward", "exact")),
    "hard+baseline": Arm("exact answers only, all-equal groups against the running baseline",
                         ("--reward", "exact"), ("train.flat_groups=baseline",)),
    "hard+replay": Arm("exact answers only, up to 8 earlier successes trained on again per step",
                       ("--reward", "exact"), ("train.replay_successes=8",)),
    "hard+baseline+replay": Arm("exact answers only, all-equal groups against the running baseline, up to 8 "
                                "earlier successes trained on again per step", ("--reward", "exact"),
                                ("train.flat_groups=baseline", "train.replay_successes=8")),
    "hard+defaults": Arm("exact answers only, the trainer with serve --train's defaults (not the demo's): "
                         "all-equal groups against the running baseline", ("--reward", "exact"), SERVE_DEFAULTS),
    "hard+defaults+set-aside": Arm("exact answers only, the trainer with serve --train's defaults but all-equal "
                                   "groups set aside (the default before this pair's runs)", ("--reward", "exact"),
                                   (*SERVE_DEFAULTS, "train.flat_groups=set_aside")),
    "hard+singletons": Arm("exact answers only, one attempt per problem",
                           ("--reward", "exact", "--group-size", "1", "--no-group")),
    "grouped+disk": Arm("the demo's traffic; full weights published through disk, as before they went from memory",
                        train=("train.weight_transfer=disk",)),
    "grouped+state-inline": Arm("the demo's traffic; each version's resume state (optimizer, sharded) written "
                                "before the version is recorded and published, as before it moved to the "
                                "background", train=("train.state_in_background=false",)),
    "grouped+overlap": Arm("the demo's traffic; async mode, each publish overlapping the next step",
                           train=("train.mode=async", "train.publish_overlap=true")),
    "grouped+fast-vllm": Arm("the demo's traffic; vLLM on the CPU with 32-token KV-cache blocks, so the prompts' "
                             "shared beginning comes from the prefix cache, and every core (engine.block_size=32, "
                             "engine.cpu_cores=all)", train=("engine.block_size=32", "engine.cpu_cores=all")),
    "multi-turn": Arm("LangChain tool agent: 3 numbers added in 2 forced tool calls, then the answer; one reward "
                      "at the end, partial credit", ("--operands", "3", "--reward", "partial"),
                      demo=("--agent", "tools")),
    "multi-turn-2": Arm("LangChain tool agent: 2 numbers added in 1 forced tool call, then the answer; one reward "
                        "at the end, partial credit", ("--operands", "2", "--reward", "partial"),
                        demo=("--agent", "tools")),
    "multi-turn-correct": Arm("as multi-turn, paid only when the answer's first number is the total",
                              ("--operands", "3", "--reward", "correct"), demo=("--agent", "tools")),
    "multi-turn-2-correct": Arm("as multi-turn-2, paid only when the answer's first number is the total (the tool "
                                "agent's defaults)",
                                ("--operands", "2", "--reward", "correct"), demo=("--agent", "tools")),
}


CANDIDATES = ("multi-turn", "multi-turn-2", "multi-turn-correct", "late+staleness4", "hard+replay", "hard+defaults",
              "hard+defaults+set-aside")
"""Arms tried on the validation split and not (or not yet) chosen: run only when named. The `hard+defaults`
pair decided whether `train.flat_groups: baseline` should become the default, by a rule fixed before its
runs: over validation seeds 100 and 101, baseline becomes the default only if its mean held-out reward after
the run beats set_aside's by more than 0.01 and it trains on a larger share of the generated episodes. It
did (0.445 against 0.422; 88% against 28% trained on), so `hard+defaults` now runs with baseline and
`hard+defaults+set-aside` with the default before (their runs were made as `hard+defaults+baseline` and
`hard+defaults`, renamed in the results)."""
DEFAULT_ARMS = [arm for arm in ARMS if arm not in CANDIDATES]


def results_name(split: str) -> str:
    """The test split's results are the benchmark's; runs on the validation split (choosing settings or a
    task) go to a file of their own, so that nothing chosen on them is ever read off the test split."""
    return NAME if split == "test" else f"{NAME}_{split}"


def run_arm(arm: str, seed: int, episodes: int, minutes: float, eval_size: int, out: Path,
            split: str = "test") -> dict[str, Any]:
    spec = ARMS[arm]
    shutil.rmtree(out, ignore_errors=True)
    agent = " ".join(("--episodes", str(episodes), *spec.agent))
    command = [sys.executable, "-m", "tracetrain.cli", "demo", "--seed", str(seed), "--minutes", str(minutes),
               "--eval-size", str(eval_size), "--eval-split", split, "--out", str(out), "--agent-args", agent,
               *spec.demo,
               *(f"--set={s}" for s in spec.train)]
    tag = escape(f"[{arm} seed {seed}]")  # rich would read the brackets as markup
    started = run_started()
    console.log(f"{tag} {' '.join(command[3:])}")
    began = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.log").open("wb") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # GBs per run; the store, logs and summary stay
    info = provenance(started)
    summary |= {"arm": arm, "wall_minutes": (time.monotonic() - began) / 60, "episode_budget": episodes,
                "eval_size": eval_size, "eval_split": split, "provenance": {k: info[k] for k in RUN_PROVENANCE}}
    console.log(f"{tag} held-out {summary['before']['mean_reward']:.3f} -> "
                f"{summary['after']['mean_reward']:.3f}; {summary['episodes']} episodes, trained on "
                f"{summary['trained_share']:.0%}; set aside {summary['set_aside']}; "
                f"{summary['wall_minutes']:.1f} min")
    return summary


def _set_aside(run: dict[str, Any]) -> dict[str, int]:
    """Sessions set aside by reason, as the store held them at the end of the run. Runs recorded before the
    demo's summary took them from the store summed the versions' step figures instead, which miss whatever
    was set aside after the last version; their store counts are in `left_in_store`."""
    return run.get("left_in_store", {}).get("set_aside", run["set_aside"])  # type: ignore[no-any-return]


RUN_PROVENANCE = ("git_sha", "cpu_model", "load_average_start", "load_average", "started_utc", "ended_utc")
"""Kept with each run: with `--keep`, the runs of one results file may come from several sittings."""


def kept_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The current results file's runs with this invocation's episode budget and held-out size, except those
    it is about to run again: `--keep` adds seeds (or arms) to a results file one sitting at a time."""
    path = args.results_dir / f"{results_name(args.eval_split)}.json"
    if not args.keep or not path.exists():
        return []
    again = {(arm, seed) for arm in args.arms for seed in args.seeds}
    runs: list[dict[str, Any]] = json.loads(path.read_text())["raw"]["runs"]
    return [r for r in runs if (r["arm"], r["seed"]) not in again
            and r.get("episode_budget") == args.episodes and r.get("eval_size") == args.eval_size]


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _right_answers(run: dict[str, Any]) -> str:
    """The tool agent's held-out share of answers whose first number is the total, before → after (its runs
    from before `correct` was reported paid exactly that, so their `exact` is it); – for the other agents."""
    if "operands" not in run["after"]:
        return "–"
    before, after = (run[k].get("correct", run[k]["exact"]) for k in ("before", "after"))
    return f"{before:.1%} → {after:.1%}"


def report(args: argparse.Namespace, runs: list[dict[str, Any]], started: RunStart, *,
           recorded: dict[str, Any] | None = None) -> Path:
    """The tables, plot and notes for `runs`. `recorded`: the results file being re-rendered (`--report-only`),
    whose command and provenance stay."""
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    table = ResultTable(f"held-out mean reward ({args.eval_size} {args.eval_split} problems, greedy): mean (min–max) "
                        "over each arm's seeds",
                        ["arm", "traffic", "seeds", "before (untrained)", "after", "gain", "episodes", "rewarded",
                         "trained on", "set aside (by reason, mean per run)", "versions"])
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        reasons = sorted({k for r in mine for k, n in _set_aside(r).items() if n})
        aside = ", ".join(f"{k} {statistics.fmean(_set_aside(r).get(k, 0) for r in mine):.0f}" for k in reasons)
        table.add(arm, ARMS[arm].label, ", ".join(str(seed) for seed in sorted({r["seed"] for r in mine})),
                  _spread([r["before"]["mean_reward"] for r in mine]),
                  _spread([r["after"]["mean_reward"] for r in mine]),
                  _spread([r["after"]["mean_reward"] - r["before"]["mean_reward"] for r in mine], "{:+.3f}"),
                  _spread([float(r["episodes"]) for r in mine], "{:.0f}"),
                  _spread([float(r["rewarded_episodes"]) for r in mine], "{:.0f}"),
                  _spread([100 * r["trained_share"] for r in mine], "{:.0f}%"), aside or "none",
                  _spread([float(r["versions"]) for r in mine], "{:.0f}"))
    per_run = ResultTable("every run, in the order run",
                          ["seed", "arm", "before", "after", "exact after", "right answers before → after",
                           "episodes", "trained on", "samples replayed", "versions", "minutes"])
    for r in runs:
        per_run.add(r["seed"], r["arm"], f"{r['before']['mean_reward']:.3f}", f"{r['after']['mean_reward']:.3f}",
                    f"{r['after']['exact']:.1%}", _right_answers(r), r["episodes"], f"{r['trained_share']:.0%}",
                    r.get("replayed_samples", "–"), r["versions"], f"{r['wall_minutes']:.1f}")
    parts = list(dict.fromkeys(k for r in runs for k in r.get("step_time_s", {})))
    times = ResultTable("where a step's time went: seconds per version, mean over the arm's runs that timed the "
                        "part (– where none did: no version, or a run from before the part was timed)",
                        ["arm", *parts, "step total"])
    for arm in arms:
        mine = [r.get("step_time_s", {}) for r in runs if r["arm"] == arm]
        means = {p: statistics.fmean(m[p] for m in mine if p in m) for p in parts if any(p in m for m in mine)}
        total = sum(v for p, v in means.items() if p != "first_call")
        times.add(arm, *(f"{means[p]:.2f}" if p in means else "–" for p in parts), f"{total:.2f}" if means else "–")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    name = results_name(args.eval_split)
    plot = args.results_dir / f"{name}.png"
    _plot(runs, arms, plot)
    notes = [f"each run: `tracetrain demo --seed N --eval-size {args.eval_size} --agent-args '--episodes "
             f"{args.episodes} …'` with the demo's trainer settings (tracetrain/demo/run.py DEMO_TRAINING) and the "
             f"arm's flags (ARMS in bench/learning_arms.py); a run stops at {args.episodes} episodes or "
             f"{args.minutes:g} minutes, whichever comes first",
             "trained on: sessions the trainer's steps used, over episodes the agent generated; an unrewarded "
             "session is never trained on, and one set aside stays in the store unconsumed",
             "the agent logs the true reward of every episode; the trainer sees only what was posted (flipped, "
             "late or not at all)",
             f"plot: `{plot.name}`"]
    notes += [f"{r['arm']} seed {r['seed']}: {r['note']}" for r in runs if r.get("note")]
    renamed = sorted({(r["made_as"], r["arm"], r["provenance"]["git_sha"][:12]) for r in runs if r.get("made_as")})
    if renamed:
        notes.append("runs renamed after they ran, their settings unchanged (the default they ran under changed): "
                     + "; ".join(f"`{arm}` was made as `{was}` at git {sha}" for was, arm, sha in renamed))
    sittings = sorted({(r["provenance"]["started_utc"][:10], r["provenance"]["git_sha"][:12]) for r in runs
                       if "provenance" in r})
    if len(sittings) > 1:
        notes.append("runs from several sittings (`--keep`), each run's provenance in the JSON: "
                     + "; ".join(f"{day} at git {sha}" for day, sha in sittings))
    heading = "Learning from production-shaped traffic" + ("" if name == NAME else f" ({args.eval_split} split)")
    command = recorded["command"] if recorded else command_line("bench.learning_arms")
    if recorded:
        notes.append("tables re-rendered from the JSON's runs by `--report-only`; command and provenance are the "
                     "last sitting's")
    return write_results(name, heading, command, [table, times, per_run], notes, raw={"runs": runs},
                         started=started, results_dir=args.results_dir,
                         info=recorded["provenance"] if recorded else None)


def _plot(runs: list[dict[str, Any]], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(arms)), 4.5))
    for i, arm in enumerate(arms):
        gains = [r["after"]["mean_reward"] - r["before"]["mean_reward"] for r in runs if r["arm"] == arm]
        ax.bar(i, statistics.fmean(gains), color="tab:blue", alpha=0.5)
        ax.scatter([i] * len(gains), gains, color="black", s=12, zorder=3)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(arms)), arms, rotation=20)
    ax.set_ylabel("held-out reward gain (after − before)")
    ax.set_title("learning per traffic shape (bar: mean over seeds; dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.learning_arms", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=DEFAULT_ARMS,
                        help=f"default: all but the multi-turn candidates not chosen ({', '.join(CANDIDATES)})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--episodes", type=int, default=512, help="episode budget of every run")
    parser.add_argument("--minutes", type=float, default=20.0, help="a run's cap, should the budget take longer")
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--eval-split", choices=["test", "validation"], default="test",
                        help="the held-out set: `validation` to choose settings or a task (its own results file)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the current results file's runs of other seeds or arms (same episode budget and "
                        "held-out size), so that seeds can be run one sitting at a time")
    add_results_dir_argument(parser)
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: re-render the current results file's tables and plot from its runs")
    args = parser.parse_args(argv)
    started = run_started()
    if args.report_only:
        recorded = json.loads((args.results_dir / f"{results_name(args.eval_split)}.json").read_text())
        console.print(f"results: {report(args, recorded['raw']['runs'], started, recorded=recorded)}")
        return
    kept = kept_runs(args)
    runs: list[dict[str, Any]] = []
    order = list(args.arms)
    total = len(order) * len(args.seeds)
    for k, seed in enumerate(args.seeds):
        rotated = order[k % len(order):] + order[: k % len(order)]
        for arm in rotated:
            console.log(f"run {len(runs) + 1} of {total}")
            runs.append(run_arm(arm, seed, args.episodes, args.minutes, args.eval_size,
                                OUT_DIR / NAME / f"{arm}-seed{seed}", args.eval_split))
    console.print(f"results: {report(args, kept + runs, started)}")


if __name__ == "__main__":
    main()
