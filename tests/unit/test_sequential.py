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


def test_looking_after_every_few_sessions_keeps_wrong_rollbacks_within_alpha() -> None:
    """Equal arms (Bernoulli 0.5), the test run every 10 sessions up to 3000: a rollback is an error."""
    rng = random.Random(1)
    runs, rollbacks, promotions = 60, 0, 0
    for _ in range(runs):
        canary: list[float] = []
        incumbent: list[float] = []
        for n in range(1, 3001):
            canary.append(float(rng.random() < 0.5))
            incumbent.append(float(rng.random() < 0.5))
            if n % 10 == 0 and n >= 20:
                outcome = decide(canary, incumbent, **SETTINGS).outcome
                if outcome != "wait":
                    rollbacks += outcome == "rollback"
                    promotions += outcome == "promote"
                    break
    assert rollbacks <= 0.05 * runs + 2
    assert promotions >= runs - rollbacks - 2  # it does decide
