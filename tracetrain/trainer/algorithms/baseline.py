"""A running baseline for groups of one (REINFORCE with a baseline, Williams 1992).

GRPO/RLOO need several samples of the same prompt; agents in the wild often produce one. For those,
the advantage is the reward minus an exponential moving average of earlier rewards of the same group
key, falling back to the average over all groups for a key not seen before.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunningBaseline:
    momentum: float = 0.9
    """Weight of the old average on each update; 0 uses only the latest reward."""
    by_group: dict[str, float] = field(default_factory=dict)
    overall: float | None = None

    def value(self, group: str) -> float:
        if group in self.by_group:
            return self.by_group[group]
        return 0.0 if self.overall is None else self.overall

    def advantage(self, group: str, reward: float) -> float:
        """Reward minus the baseline as it stood before this reward; then the baseline moves."""
        advantage = reward - self.value(group)
        self.update(group, reward)
        return advantage

    def flat_group(self, group: str, rewards: list[float]) -> list[float]:
        """A group whose rewards are all equal, which a group estimator gives no signal: each reward minus
        the baseline as it stood before the group, the same for every member whatever their order; then
        the baseline moves. Deviation from GRPO: these advantages are not divided by a standard deviation
        (there is none), as in Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training")."""
        value = self.value(group)
        for reward in rewards:
            self.update(group, reward)
        return [reward - value for reward in rewards]

    def update(self, group: str, reward: float) -> None:
        self.by_group[group] = self._mix(self.by_group.get(group), reward)
        self.overall = self._mix(self.overall, reward)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.momentum * old + (1 - self.momentum) * new

    def state_dict(self) -> dict[str, object]:
        return {"momentum": self.momentum, "by_group": dict(self.by_group), "overall": self.overall}

    @classmethod
    def from_state(cls, state: dict[str, object]) -> RunningBaseline:
        return cls(momentum=float(state["momentum"]), by_group=dict(state["by_group"]),  # type: ignore[arg-type, call-overload]
                   overall=state["overall"])  # type: ignore[arg-type]
