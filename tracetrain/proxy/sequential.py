"""The canary's sequential test: is the new version's mean session reward worse than the incumbent's?

We use an always-valid confidence sequence for the difference of the two means, the normal-mixture
sequential probability ratio test (mSPRT) of Johari, Koomen, Pekelis and Walsh, "Peeking at A/B Tests:
Why it matters, and what to do about it" (KDD 2017), after Robbins (1970). With `d` the difference of
the sample means (canary − incumbent), `V` its variance and a normal mixing distribution of variance
`tau²` over the true difference, the interval

    d ± sqrt( V (V + tau²) / tau² · (2 ln(1/alpha) + ln((V + tau²) / V)) )

holds the true difference with probability at least 1 − alpha *at every sample size at once*, so the
test may be evaluated after every new reward without inflating its error rate, which a fixed-sample
t-test evaluated repeatedly would.

The decision is a non-inferiority test with margin `m` (Wellek, "Testing Statistical Hypotheses of
Equivalence and Noninferiority", 2010):
- promote when the whole interval lies above −m (the canary is not worse by more than m);
- roll back when the whole interval lies below −m (it is worse by more than m);
- otherwise wait, and once the canary has `max_sessions` rewarded sessions decide on the point
  estimate (promote when d > −m).

Neither decision is taken before both arms have `min_sessions` rewards.

Deviations from the paper: `V` uses the sample variances (the paper assumes known variances; with the
minimum sample count this plug-in is the usual practice), floored so that arms with identical rewards
do not give a zero-width interval, and `tau` is the margin itself (the effect size the test is tuned to
find, as the paper recommends), or 0.1 when the margin is 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Outcome = Literal["promote", "rollback", "wait"]

VARIANCE_FLOOR = 1e-6
"""Smallest variance of the difference: rewards that are all equal still leave a little doubt."""


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: str
    canary_n: int
    incumbent_n: int
    canary_mean: float | None
    incumbent_mean: float | None
    difference: float | None
    interval: tuple[float, float] | None
    """Always-valid interval for canary − incumbent at level 1 − alpha."""
    margin: float
    alpha: float

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["interval"] = list(self.interval) if self.interval else None
        return values


def half_width(variance: float, *, alpha: float, tau: float) -> float:
    """Half the width of the mSPRT confidence sequence for a difference with variance `variance`."""
    v = max(variance, VARIANCE_FLOOR)
    t2 = tau * tau
    return math.sqrt(v * (v + t2) / t2 * (2 * math.log(1 / alpha) + math.log((v + t2) / v)))


def decide(canary: Sequence[float], incumbent: Sequence[float], *, margin: float, alpha: float,
           min_sessions: int, max_sessions: int) -> Decision:
    """The test on the final rewards of each arm's sessions so far."""
    nc, ni = len(canary), len(incumbent)
    if nc < min_sessions or ni < min_sessions:
        return Decision("wait", f"each arm needs {min_sessions} rewarded sessions", nc, ni, None, None, None, None,
                        margin, alpha)
    mc, mi = statistics.fmean(canary), statistics.fmean(incumbent)
    d = mc - mi
    variance = statistics.variance(canary) / nc + statistics.variance(incumbent) / ni
    w = half_width(variance, alpha=alpha, tau=margin or 0.1)
    low, high = d - w, d + w

    def result(outcome: Outcome, reason: str) -> Decision:
        return Decision(outcome, reason, nc, ni, mc, mi, d, (low, high), margin, alpha)

    if low > -margin:
        return result("promote", f"not worse: the interval's lower end {low:.4f} is above -{margin:g}")
    if high < -margin:
        return result("rollback", f"worse: the interval's upper end {high:.4f} is below -{margin:g}")
    if nc >= max_sessions:
        verdict: Outcome = "promote" if d > -margin else "rollback"
        return result(verdict, f"undecided at {nc} canary sessions: the mean difference {d:.4f} is "
                      f"{'above' if verdict == 'promote' else 'not above'} -{margin:g}")
    return result("wait", "the interval still spans the margin")
