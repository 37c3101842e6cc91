"""The learning-speed report's time-to-threshold ratio against the issue's target (<= 1.0x TRL, 0.7x stretch)."""

from __future__ import annotations

from bench.learning_speed_report import ArmRun, EvalPoint, time_ratio

NAMES = ("tracetrain + vLLM", "TRL + HF generate")


def run(arm: str, seed: int, reached_at: float | None, budget_s: float = 600.0) -> ArmRun:
    """A run whose held-out reward jumps from 0.3 to 0.6 at `reached_at` seconds (never, when None)."""
    points = [EvalPoint(t=0.0, reward=0.3, exact=0.0, step=0, seconds=5.0, episodes=0)]
    points += [EvalPoint(t=t, reward=0.6 if reached_at is not None and t >= reached_at else 0.3, exact=0.0,
                         step=int(t // 20), seconds=5.0, episodes=int(t)) for t in range(60, int(budget_s) + 1, 60)]
    return ArmRun(arm=arm, seed=seed, lr=2e-4, split="test", budget_s=budget_s, points=points)


def test_the_ratio_is_of_the_means_with_the_per_seed_range_and_the_verdict() -> None:
    ours = [run("tt", 0, 120), run("tt", 1, 240)]
    theirs = [run("trl", 0, 240), run("trl", 1, 240)]
    line = time_ratio(ours, theirs, NAMES, 0.55)
    # means 180 s against 240 s: 0.75x; seed 0 took half of TRL's time, seed 1 the same
    assert "takes 0.75x TRL + HF generate's time" in line
    assert "per seed 0.50x-1.00x" in line
    assert line.endswith("meets the target")


def test_slower_than_trl_misses_and_faster_than_the_stretch_meets_it() -> None:
    assert time_ratio([run("tt", 0, 480)], [run("trl", 0, 240)], NAMES, 0.55).endswith("misses the target")
    assert time_ratio([run("tt", 0, 120)], [run("trl", 0, 240)], NAMES, 0.55).endswith("meets the stretch")


def test_a_run_that_never_reaches_the_threshold_makes_the_ratio_a_bound() -> None:
    line = time_ratio([run("tt", 0, None)], [run("trl", 0, 300)], NAMES, 0.55)
    assert "takes 2.00x" in line  # the budget, 600 s, against 300 s
    assert "1 run(s) never reached 0.55" in line and "a bound, not a measurement" in line
