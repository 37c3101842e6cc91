"""The canary's sequential test (proxy/sequential.py): its decisions, and its error rate when it is
evaluated again and again as rewards arrive (the reason for an always-valid interval)."""

from __future__ import annotations

import random

from tracetrain.proxy.sequential import decide, half_width

SETTINGS = {"margin": 0.1, "alpha": 0.05, "min_sessions": 20, "max_sessions": 5000}


def test_nothing_is_decided_before_each_arm_has_its_minimum() -> None:
    result = decide([0.0] * 19, [1.0] * 100, **SETTINGS)
    assert result.outcome == "wait" and result.interval is None and result.canary_n == 19


def test_a_broken_canary_is_rolled_back_and_an_identical_one_promoted_at_the_minimum() -> None:
    assert decide([0.0] * 20, [1.0] * 20, **SETTINGS).outcome == "rollback"
    same = decide([1.0] * 20, [1.0] * 20, **SETTINGS)
    assert same.outcome == "promote" and same.difference == 0.0


def test_the_interval_narrows_with_more_sessions_and_is_wider_than_a_fixed_sample_one() -> None:
    widths = [half_width(0.5 / n, alpha=0.05, tau=0.1) for n in (20, 200, 2000)]
    assert widths[0] > widths[1] > widths[2]
    assert widths[1] > 1.96 * (0.5 / 200) ** 0.5  # the price of being valid at every look


def test_at_the_cap_the_mean_decides() -> None:
    rng = random.Random(0)
    canary = [float(rng.random() < 0.5) for _ in range(60)]
    incumbent = [float(rng.random() < 0.5) for _ in range(60)]
    result = decide(canary, incumbent, margin=0.0, alpha=0.05, min_sessions=20, max_sessions=60)
    assert result.outcome == ("promote" if result.difference and result.difference > 0 else "rollback")
    assert "undecided at 60" in result.reason


def _peek_until_decided(rng: random.Random, canary_p: float, sessions: int) -> str:
    """Bernoulli rewards for both arms, the test evaluated every 10 sessions until it decides."""
    canary: list[float] = []
    incumbent: list[float] = []
    for n in range(1, sessions + 1):
        canary.append(float(rng.random() < canary_p))
        incumbent.append(float(rng.random() < 0.5))
        if n % 10 == 0 and n >= 20:
            outcome = decide(canary, incumbent, **SETTINGS).outcome
            if outcome != "wait":
                return outcome
    return "wait"


def test_looking_after_every_few_sessions_keeps_wrong_rollbacks_within_alpha() -> None:
    """Equal arms, the test run every 10 sessions up to 3000: a rollback is an error, and errors stay
    within alpha (no slack added to the bound)."""
    rng = random.Random(1)
    outcomes = [_peek_until_decided(rng, 0.5, 3000) for _ in range(60)]
    assert outcomes.count("rollback") <= SETTINGS["alpha"] * len(outcomes)
    assert outcomes.count("promote") >= len(outcomes) - outcomes.count("rollback") - 2  # it does decide


def test_at_the_margin_repeated_looks_decide_wrongly_at_most_alpha_of_the_time() -> None:
    """The hardest case for the error rate: the canary is worse by exactly the margin (0.4 against 0.5,
    margin 0.1), so the always-valid interval must keep the true difference in it, and both a rollback
    ("worse by more than the margin") and a promotion ("not worse by more than it") exclude it. Peeking
    every 10 sessions up to 1000, at most alpha of the runs may decide at all."""
    rng = random.Random(3)
    outcomes = [_peek_until_decided(rng, 0.4, 1000) for _ in range(100)]
    decided = len(outcomes) - outcomes.count("wait")
    assert decided <= SETTINGS["alpha"] * len(outcomes)
