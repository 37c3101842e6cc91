"""Runs, metrics, tables and plots of `bench/learning_speed.py` (kept apart so that module stays small).

Everything here reads finished runs; nothing starts a process. The metrics themselves are defined (and
fixed before any run) in `bench.learning_speed.METRICS`; the functions below compute exactly those.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import ResultTable, RunStart, console, write_results

NAME = "learning_speed"

Pairing = tuple[str, str, Sequence[str]]
"""(key, title, arm keys): the arms of one comparison, tracetrain's first."""


class ArmClock:
    """An arm's clock: seconds since it was made (before any of the arm's processes started), less the
    time spent in held-out evaluations, which no arm is charged for. `t0` is the wall-clock start (a
    child process makes its own clock from the parent's)."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.time() if t0 is None else t0
        self.excluded = 0.0
        self._paused_at: float | None = None

    def __call__(self) -> float:
        now = time.time() if self._paused_at is None else self._paused_at
        return now - self.t0 - self.excluded

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stops the clock for the block (an evaluation): it reads the same before and after."""
        self._paused_at = time.time()
        try:
            yield
        finally:
            self.excluded += time.time() - self._paused_at
            self._paused_at = None


@dataclass
class EvalPoint:
    t: float
    """Seconds on the arm's clock (evaluation time excluded, see `ArmClock`) when this evaluation ran:
    the policy it measured existed by then."""
    reward: float
    """Mean `score` over the held-out problems, greedy, MAX_TOKENS answer tokens."""
    exact: float
    step: int
    """Optimizer steps taken: TRL's global step; tracetrain's highest policy version that answered."""
    seconds: float
    """How long the evaluation itself took (wall-clock; not on the arm's clock)."""
    episodes: int
    """Training completions generated so far."""
    versions: list[int] = field(default_factory=list)
    """tracetrain: every policy version that answered (a new one may start serving mid-evaluation)."""


@dataclass
class ArmRun:
    """One arm, one seed, one learning rate: a fresh process with its own wall-clock budget."""

    arm: str
    seed: int
    lr: float
    split: str
    budget_s: float
    order: int = 0
    """Position of this arm among its seed's runs (0: ran first)."""
    startup_s: float = 0.0
    points: list[EvalPoint] = field(default_factory=list)
    steps: int = 0
    train_end_s: float = 0.0
    """When training stopped (tracetrain: the agent's deadline; TRL: `train()` returned)."""
    total_s: float = 0.0
    episodes: int = 0
    samples_per_step: float | None = None
    """Mean samples trained per optimizer step (tracetrain: from `/v1/policies` metrics)."""
    step_samples: list[int] = field(default_factory=list)
    """Samples trained in each optimizer step, in order."""
    sessions_per_step: float | None = None
    """Mean sessions consumed per step, including those dropped (zero-variance groups, stale)."""
    optimizer: str = ""
    load: float = 0.0
    """1-minute load average just before the arm started."""
    trained_sessions: int = 0
    """tracetrain: sessions its steps learned from (sum of the versions' `sessions`)."""
    set_aside: dict[str, int] = field(default_factory=dict)
    """tracetrain: sessions its trainer left unconsumed in the store, by reason."""
    staleness: dict[str, int] = field(default_factory=dict)
    """tracetrain: samples trained on, by how many versions behind the trainer they were."""
    drain_s: float | None = None
    """tracetrain with a drain: how long the trainer went on after the budget, agents stopped."""
    trained_after_drain: int | None = None
    """Sessions learned from once the drain ended (all generated within the budget)."""
    set_aside_after_drain: dict[str, int] = field(default_factory=dict)
    sharpening: list[dict[str, Any]] = field(default_factory=list)
    """tracetrain: how its sampling sharpened, per window of versions (`bench.sharpening.windows`)."""
    ready_after_drain: int | None = None
    """Finished sessions still unused after the drain (fewer than a batch)."""
    step_times: dict[str, float] = field(default_factory=dict)
    """tracetrain: mean wall-clock seconds per optimizer step in each phase (the versions' `time_s`)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmRun:
        return cls(**{**data, "points": [EvalPoint(**p) for p in data["points"]]})

    def read_steps(self, policies: list[dict[str, Any]]) -> None:
        """Fill the per-step fields from a `/v1/policies` listing (or the same rows from a run's store)."""
        self.step_samples, self.sessions_per_step = step_sizes(policies)
        self.step_times = step_times(policies)
        self.samples_per_step = sum(self.step_samples) / len(self.step_samples) if self.step_samples else None


# --- metrics ---------------------------------------------------------------------------------------


def reward_at(run: ArmRun, t: float) -> float:
    """Held-out reward at time `t`: that of the latest evaluation finished by then; before the first
    evaluation, the first evaluation's value (both arms evaluate the base model right after start-up)."""
    value = run.points[0].reward
    for p in run.points:
        if p.t > t:
            break
        value = p.reward
    return value


def auc(run: ArmRun) -> float:
    """Time-averaged held-out reward over [0, budget] (metric 2)."""
    inside = [p for p in run.points if p.t < run.budget_s]
    if not inside:
        return run.points[0].reward
    area = inside[0].t * inside[0].reward
    for a, b in zip(inside, inside[1:], strict=False):
        area += (b.t - a.t) * a.reward
    area += (run.budget_s - inside[-1].t) * inside[-1].reward
    return area / run.budget_s


def time_to(run: ArmRun, threshold: float) -> float | None:
    """Seconds until an evaluation finished within the budget reached `threshold` (metric 1); None: not reached."""
    return next((p.t for p in run.points if p.t <= run.budget_s and p.reward >= threshold - 1e-9), None)


def final(run: ArmRun) -> float:
    return run.points[-1].reward


def steps_per_minute(run: ArmRun) -> float:
    """Optimizer steps per minute of training (from start-up's end to training's end)."""
    minutes = (run.train_end_s - run.startup_s) / 60
    return run.steps / minutes if minutes > 0 else 0.0


def reward_at_step(run: ArmRun, step: int) -> float:
    """Held-out reward of the latest evaluation taken at or before `step` optimizer steps (metric 3)."""
    value = run.points[0].reward
    for p in run.points:
        if p.step <= step:
            value = p.reward
    return value


def common_steps(runs: Sequence[ArmRun]) -> int:
    """The most steps every run of an arm was evaluated at: the per-step curve is averaged up to here."""
    return min(max(p.step for p in r.points) for r in runs)


@dataclass
class Spread:
    mean: float
    low: float
    high: float
    std: float
    """Sample standard deviation (n - 1); 0 for one run."""
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.fmean(values), min(values), max(values),
                   statistics.stdev(values) if len(values) > 1 else 0.0, len(values))


def time_or_budget(run: ArmRun, threshold: float) -> float:
    """Time to threshold in seconds, "not reached" counted as the budget."""
    reached = time_to(run, threshold)
    return run.budget_s if reached is None else reached


def threshold_spread(runs: Sequence[ArmRun], threshold: float) -> tuple[Spread, int]:
    """Time to threshold in seconds over seeds, "not reached" counted as the budget; and how many reached it."""
    return Spread.of([time_or_budget(r, threshold) for r in runs]), sum(time_to(r, threshold) is not None
                                                                        for r in runs)


def mean_aucs(runs: Sequence[ArmRun]) -> dict[tuple[str, float], float]:
    """AUC per (arm, lr), the mean over that grid point's runs (its seeds)."""
    points: dict[tuple[str, float], list[float]] = {}
    for r in runs:
        points.setdefault((r.arm, r.lr), []).append(auc(r))
    return {point: statistics.fmean(values) for point, values in points.items()}


def pick_lrs(runs: Sequence[ArmRun]) -> dict[str, float]:
    """Per arm, the learning rate with the highest validation AUC (mean over its runs)."""
    means = mean_aucs(runs)
    return {arm: max((lr for a, lr in means if a == arm), key=lambda lr: means[arm, lr])
            for arm in dict.fromkeys(a for a, _ in means)}


def step_sizes(policies: list[dict[str, Any]]) -> tuple[list[int], float | None]:
    """Samples trained per step, and mean sessions taken per step (those set aside included), from the
    policies' metrics. Since the trainer records `samples_total`, `metrics.samples` is the step's own
    count; older stores kept only a running total in `samples`, and the differences are taken then."""
    rows = sorted((p for p in policies if int(p["version"]) > 0 and p.get("metrics")), key=lambda p: int(p["version"]))
    if not rows:
        return [], None
    metrics = [r["metrics"] for r in rows]
    if all("samples_total" in m for m in metrics):
        taken = [int(m.get("sessions", 0)) + sum(int(n) for n in (m.get("set_aside") or {}).values()) for m in metrics]
        return [int(m["samples"]) for m in metrics], sum(taken) / len(taken)
    totals = [int(m.get("samples", 0)) for m in metrics]
    consumed = sum(int(metrics[-1].get(k, 0)) for k in ("samples", "stale", "zero_variance"))
    return [b - a for a, b in zip([0, *totals], totals, strict=False)], consumed / len(rows)


def step_times(policies: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per optimizer step in each phase the trainer records (`metrics.time_s`: waiting for data,
    claiming, forward/backward, optimizer, checkpoint, publish), over the versions that record it."""
    rows = [p["metrics"]["time_s"] for p in policies
            if int(p["version"]) > 0 and (p.get("metrics") or {}).get("time_s")]
    phases = list(dict.fromkeys(phase for row in rows for phase in row))
    return {phase: sum(row.get(phase, 0.0) for row in rows) / len(rows) for phase in phases}


# --- report ----------------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.2f}"


def summary_table(title: str, arms: Sequence[str], runs: Sequence[ArmRun], labels: dict[str, str],
                  lrs: dict[str, tuple[float, str]], threshold: float) -> ResultTable:
    table = ResultTable(title, ["arm", "lr", "seeds", f"min to {threshold:g}: mean", "min", "max", "std",
                                "reached", "AUC mean", "min", "max", "std", "final mean", "min", "max",
                                "opt. steps", "steps/min", "samples/step", "start-up s"])
    for arm in arms:
        mine = [r for r in runs if r.arm == arm]
        if not mine:
            continue
        time, reached = threshold_spread(mine, threshold)
        area, last = Spread.of([auc(r) for r in mine]), Spread.of([final(r) for r in mine])
        steps = Spread.of([r.steps for r in mine])
        sizes = [r.samples_per_step for r in mine if r.samples_per_step is not None]
        table.add(labels[arm], f"{lrs[arm][0]:g}", len(mine), _minutes(time.mean), _minutes(time.low),
                  _minutes(time.high), _minutes(time.std), f"{reached}/{len(mine)}", _f(area.mean), _f(area.low),
                  _f(area.high), _f(area.std), _f(last.mean), _f(last.low), _f(last.high),
                  f"{steps.mean:.1f} ({steps.low:.0f}-{steps.high:.0f})",
                  f"{statistics.fmean(steps_per_minute(r) for r in mine):.2f}",
                  f"{statistics.fmean(sizes):.1f}" if sizes else "-",
                  f"{statistics.fmean(r.startup_s for r in mine):.0f}")
    return table


def step_table(title: str, arms: Sequence[str], runs: Sequence[ArmRun], labels: dict[str, str]) -> ResultTable:
    """Held-out reward per optimizer step: mean over seeds (min-max) on a grid of steps every run covers."""
    tops = {arm: common_steps([r for r in runs if r.arm == arm]) for arm in arms if any(r.arm == arm for r in runs)}
    table = ResultTable(title, ["optimizer step", *[labels[a] for a in tops]])
    top = max(tops.values(), default=0)
    for step in sorted({round(i * top / 10) for i in range(11)}):
        cells = []
        for arm, limit in tops.items():
            if step > limit:
                cells.append("-")
                continue
            values = Spread.of([reward_at_step(r, step) for r in runs if r.arm == arm])
            cells.append(f"{values.mean:.3f} ({values.low:.3f}-{values.high:.3f})")
        table.add(step, *cells)
    return table


def runs_table(runs: Sequence[ArmRun], labels: dict[str, str], threshold: float) -> ResultTable:
    table = ResultTable("every run (order: position among its seed's arms, 0 = first)",
                        ["arm", "seed", "order", "lr", "load avg", "start-up s", "opt. steps", "samples/step",
                         "sessions/step", f"min to {threshold:g}", "AUC", "first eval", "final eval", "optimizer"])
    for r in sorted(runs, key=lambda r: (r.seed, r.order)):
        reached = time_to(r, threshold)
        table.add(labels[r.arm], r.seed, r.order, f"{r.lr:g}", f"{r.load:.1f}", f"{r.startup_s:.0f}", r.steps,
                  _f(r.samples_per_step, 1), _f(r.sessions_per_step, 1),
                  _minutes(reached) if reached is not None else "not reached", _f(auc(r)),
                  _f(r.points[0].reward), _f(final(r)), r.optimizer)
    return table


def sharpening_table(runs: Sequence[ArmRun], labels: dict[str, str]) -> ResultTable:
    """Per tracetrain run, its sampling in the first and the last window of versions holding at least
    `SHARPENING_MIN_GROUPS` groups (the last window is often a step's remnant): a collapse shows as fewer
    distinct completions, sampled tokens near logprob 0, and all-equal groups taking over."""
    table = ResultTable("how each tracetrain run's sampling sharpened: first → last window of 5 versions "
                        "(bench.sharpening)",
                        ["arm", "seed", "versions", "distinct completions per group of 8", "sampled-token logprob",
                         "all-equal groups", "training reward"])
    for r in sorted((r for r in runs if r.sharpening), key=lambda r: (r.arm, r.seed)):
        full = [w for w in r.sharpening if w["groups"] >= SHARPENING_MIN_GROUPS] or r.sharpening
        a, b = full[0], full[-1]
        table.add(labels[r.arm], r.seed, f"{a['first']}-{a['last']} → {b['first']}-{b['last']}",
                  f"{a['distinct']:.1f} → {b['distinct']:.1f}", f"{a['logprob']:.2f} → {b['logprob']:.2f}",
                  f"{a['all_equal']:.0%} → {b['all_equal']:.0%}", f"{a['reward']:.3f} → {b['reward']:.3f}")
    return table


SHARPENING_MIN_GROUPS = 10


PHASES = {"wait_data": "wait for data", "claim": "claim", "forward_backward": "forward/backward",
          "optimizer": "optimizer", "checkpoint": "checkpoint", "publish": "publish"}


def step_time_table(runs: Sequence[ArmRun], labels: dict[str, str]) -> ResultTable:
    """Per arm, mean over its seeds: seconds per optimizer step on the arm's clock, and for tracetrain where
    a step's wall-clock time went. The trainer idles while its arm evaluates, so those pauses sit inside
    "wait for data"; their share per step is shown beside it."""
    table = ResultTable("where an optimizer step's time went, mean over seeds (seconds per step; the trainer idles "
                        "while its arm evaluates, so the evaluation pauses are part of the wait for data)",
                        ["arm", "seeds", "per step, arm's clock", "evaluation pauses (wall)",
                         *[f"{name} (wall)" for name in PHASES.values()]])
    for arm in dict.fromkeys(r.arm for r in runs):
        mine = [r for r in runs if r.arm == arm and r.steps]
        if not mine:
            continue
        per_step = statistics.fmean((r.train_end_s - r.startup_s) / r.steps for r in mine)
        timed = [r for r in mine if r.step_times]
        phases = [_f(statistics.fmean(r.step_times.get(p, 0.0) for r in timed), 1) if timed else "-" for p in PHASES]
        pauses = _f(statistics.fmean(sum(p.seconds for p in r.points if p.t < r.budget_s) / r.steps
                                     for r in timed), 1) if timed else "-"
        table.add(labels[arm], len(mine), f"{per_step:.1f}", pauses, *phases)
    return table


def _compare(name: str, detail: str, ours: Spread, theirs: Spread, higher_better: bool,
             fmt: Callable[[float], str], labels: tuple[str, str]) -> tuple[str, str, bool]:
    """(metric name, a sentence on which arm wins it by mean and whether the seeds' ranges overlap, whether
    tracetrain, labels[0], won)."""
    if abs(ours.mean - theirs.mean) < 1e-9:
        return name, f"{name}{detail}: tie, {fmt(ours.mean)} each", False
    won = (ours.mean > theirs.mean) == higher_better
    win, lose = (ours, theirs) if won else (theirs, ours)
    apart = win.low > lose.high if higher_better else win.high < lose.low
    return name, (f"{name}{detail}: {labels[0] if won else labels[1]} wins, {fmt(win.mean)} vs {fmt(lose.mean)} "
                  f"(mean over {win.n} seeds; ranges {fmt(win.low)}-{fmt(win.high)} vs {fmt(lose.low)}-"
                  f"{fmt(lose.high)}{', apart' if apart else ', overlapping: not a clear difference'})"), won


def verdicts(pairing: Pairing, runs: Sequence[ArmRun], labels: dict[str, str], threshold: float) -> list[str]:
    """Who wins each metric in one pairing, derived from the numbers (tracetrain's arm is the pairing's first)."""
    key, _, arms = pairing
    ours, theirs = arms
    mine, others = [r for r in runs if r.arm == ours], [r for r in runs if r.arm == theirs]
    if not mine or not others:
        return []
    names = (labels[ours], labels[theirs])
    (t_ours, n_ours), (t_theirs, n_theirs) = threshold_spread(mine, threshold), threshold_spread(others, threshold)
    results = [_compare(f"time to held-out reward {threshold:g}",
                        f" (not reached = budget; reached {n_ours}/{len(mine)} vs {n_theirs}/{len(others)})",
                        t_ours, t_theirs, False, lambda s: f"{s / 60:.2f} min", names),
               _compare("AUC (time-averaged held-out reward)", "", Spread.of([auc(r) for r in mine]),
                        Spread.of([auc(r) for r in others]), True, lambda v: f"{v:.3f}", names),
               _compare("final held-out reward", "", Spread.of([final(r) for r in mine]),
                        Spread.of([final(r) for r in others]), True, lambda v: f"{v:.3f}", names)]
    step = min(common_steps(mine), common_steps(others))
    if step > 0:
        results.append(_compare(f"held-out reward after {step} optimizer steps", " (learning per step)",
                                Spread.of([reward_at_step(r, step) for r in mine]),
                                Spread.of([reward_at_step(r, step) for r in others]), True, lambda v: f"{v:.3f}",
                                names))
    # the time targets are issue 31's, against TRL; a study of tracetrain's own settings only compares
    lines = [text for _, text, _ in results] + ([time_ratio(mine, others, names, threshold)]
                                                if theirs.startswith("trl") else [])
    lost = [name for name, _, won in results if not won]
    summary = (f"{names[0]} does not win on: {'; '.join(lost)}" if lost else f"{names[0]} wins every metric")
    return [f"{key}: {text}" for text in lines] + [f"{key}: {summary}"]


TIME_TARGET = 1.0
"""Target: tracetrain reaches the threshold in at most this multiple of TRL's time (issue 31)."""
TIME_STRETCH = 0.7
"""The stretch target, same ratio."""


def time_ratio(mine: Sequence[ArmRun], others: Sequence[ArmRun], names: tuple[str, str], threshold: float) -> str:
    """tracetrain's time to `threshold` as a multiple of the other arm's: the ratio of the means over seeds and
    the range of the per-seed ratios (both arms of a seed see the same problems in the same order), against
    the target and the stretch. A run that never reaches the threshold counts as its budget, so when one
    did not, the sentence says the ratio is a bound, not a measurement."""
    (ours, _), (theirs, _) = threshold_spread(mine, threshold), threshold_spread(others, threshold)
    ratio = ours.mean / theirs.mean
    theirs_by_seed = {r.seed: time_or_budget(r, threshold) for r in others}
    per_seed = [time_or_budget(r, threshold) / theirs_by_seed[r.seed] for r in mine if r.seed in theirs_by_seed]
    verdict = ("meets the stretch" if ratio <= TIME_STRETCH else
               "meets the target" if ratio <= TIME_TARGET else "misses the target")
    seeds = f", per seed {min(per_seed):.2f}x-{max(per_seed):.2f}x" if per_seed else ""
    censored = sum(time_to(r, threshold) is None for r in [*mine, *others])
    caveat = (f"; {censored} run(s) never reached {threshold:g} and count as their budget, so this is a bound, "
              "not a measurement") if censored else ""
    return (f"time to {threshold:g}: {names[0]} takes {ratio:.2f}x {names[1]}'s time (ratio of means{seeds}; "
            f"target <= {TIME_TARGET:g}x, stretch <= {TIME_STRETCH:g}x): {verdict}{caveat}")


def plot(path: Path, pairings: Sequence[Pairing], runs: Sequence[ArmRun], labels: dict[str, str],
         threshold: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {"tracetrain-transformers": "tab:green", "tracetrain-vllm": "tab:olive", "trl-hf": "tab:blue",
              "tracetrain-vllm-keep": "tab:orange", "tracetrain-vllm-entropy": "tab:purple"}
    fig, axes = plt.subplots(len(pairings), 2, figsize=(13, 4.6 * len(pairings)), squeeze=False)
    for (key, _, arms), (by_time, by_step) in zip(pairings, axes, strict=True):
        for arm in arms:
            mine = [r for r in runs if r.arm == arm]
            if not mine:
                continue
            color = colors.get(arm, "tab:red")
            budget = max(r.budget_s for r in mine)
            grid = np.linspace(0, budget, 400)
            values = np.array([[reward_at(r, t) for t in grid] for r in mine])
            label = f"{labels[arm]} (lr {mine[0].lr:g}, {len(mine)} seeds)"
            by_time.plot(grid / 60, values.mean(0), color=color, label=label)
            by_time.fill_between(grid / 60, values.min(0), values.max(0), color=color, alpha=0.18)
            top = common_steps(mine)
            steps = sorted({p.step for r in mine for p in r.points if p.step <= top})
            at = np.array([[reward_at_step(r, s) for s in steps] for r in mine])
            by_step.plot(steps, at.mean(0), color=color, marker=".", drawstyle="steps-post", label=label)
            by_step.fill_between(steps, at.min(0), at.max(0), color=color, alpha=0.18, step="post")
        by_time.axhline(threshold, color="grey", linestyle="--", label=f"threshold {threshold:g}")
        by_time.set_xlabel("wall-clock minutes since the arm started (start-up and evaluations included)")
        by_step.set_xlabel("optimizer steps")
        for ax, against in ((by_time, "wall-clock"), (by_step, "optimizer steps")):
            ax.set_ylabel("held-out reward (greedy)")
            ax.set_title(f"{key}: {' vs '.join(labels[a] for a in arms)}, against {against}", fontsize="medium")
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize="small")
    fig.suptitle(f"{title}: mean over seeds, band = min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results_dir: Path, heading: str, command: str, pairings: Sequence[Pairing],
                 runs: Sequence[ArmRun], labels: dict[str, str], lrs: dict[str, tuple[float, str]], threshold: float,
                 notes: Sequence[str], raw: dict[str, Any], started: RunStart,
                 info: dict[str, Any] | None = None, name: str = NAME) -> Path:
    """`<results_dir>/<name>.{md,json,png}`: per pairing a summary and a per-step table, every run, the
    lr selection the learning rates came from (when `raw` holds it), notes."""
    tables = []
    for key, title, arms in pairings:
        tables.append(summary_table(f"{key} — {title}", arms, runs, labels, lrs, threshold))
        tables.append(step_table(f"{key}: held-out reward per optimizer step, mean (min-max) over seeds", arms, runs,
                                 labels))
    tables.append(runs_table(runs, labels, threshold))
    tables.append(step_time_table(runs, labels))
    if any(r.sharpening for r in runs):
        tables.append(sharpening_table(runs, labels))
    selection = raw.get("lr_selection")
    if selection:
        tables += [ResultTable(**{**record, "title": f"lr selection: {record['title']}"})
                   for record in selection.get("tables", [])]
    for table in tables:
        console.print(table.rich())
    verdict = [line for p in pairings for line in verdicts(p, runs, labels, threshold)]
    for line in verdict:
        console.print(line, highlight=False)
    results_dir.mkdir(parents=True, exist_ok=True)
    png = results_dir / f"{name}.png"
    plot(png, pairings, runs, labels, threshold, heading)
    lr_notes = [f"lr of {labels[arm]}: {lr:g} ({source})" for arm, (lr, source) in lrs.items()]
    path = write_results(name, heading, command, tables, [*verdict, *lr_notes, *notes, f"plot: `{png.name}`"],
                         raw={**raw, "runs": [asdict(r) for r in runs]}, started=started, results_dir=results_dir,
                         info=info)
    console.print(f"results: {path}, {png}")
    return path


def write_lr_report(results_dir: Path, command: str, runs: Sequence[ArmRun], labels: dict[str, str],
                    notes: Sequence[str], raw: dict[str, Any], started: RunStart) -> dict[str, float]:
    """`<results_dir>/learning_speed_lr.{md,json}` for `--select-lr`, the input of the measured runs (which
    copy it into their own results); returns the chosen lr per arm."""
    chosen = pick_lrs(runs)
    mean_auc = mean_aucs(runs)
    table = ResultTable("learning rate per arm, chosen by validation AUC",
                        ["arm", "lr", "seed", "validation AUC", "mean AUC over seeds", "final validation reward",
                         "opt. steps", "chosen"])
    for r in sorted(runs, key=lambda r: (r.arm, r.lr, r.seed)):
        table.add(labels[r.arm], f"{r.lr:g}", r.seed, _f(auc(r)), _f(mean_auc[r.arm, r.lr]), _f(final(r)), r.steps,
                  "yes" if chosen[r.arm] == r.lr else "")
    console.print(table.rich())
    path = write_results(f"{NAME}_lr", "Learning speed: learning rate per arm (validation split)", command, [table],
                         [*[f"{labels[a]}: lr {lr:g}" for a, lr in chosen.items()], *notes],
                         raw={**raw, "chosen": chosen, "runs": [asdict(r) for r in runs]}, started=started,
                         results_dir=results_dir)
    console.print(f"results: {path}")
    return chosen
