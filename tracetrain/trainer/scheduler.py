"""Which named policy steps next, when one trainer trains several (docs/architecture.md, decision 13).

A line is *due* when a full batch of its sessions is ready, or when at least its `min_sessions` have
been ready for its `fill_timeout_s` (the same rule one line's batch gathering follows, trainer/batch.py).
Among due lines the one that stepped least recently goes first, so a busy policy, always due, takes
every other turn at most while a quiet one has a batch waiting: it cannot starve it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Demand:
    """One line's ready sessions and what it needs to step."""

    ready: int
    batch_sessions: int
    min_sessions: int
    fill_timeout_s: float


@dataclass
class FairScheduler:
    """Least recently stepped first among the due lines; a line that never stepped before all others."""

    _turn: int = 0
    _last: dict[str, int] = field(default_factory=dict)
    _partial_since: dict[str, float] = field(default_factory=dict)
    """When each line's partial batch (at least `min_sessions`, short of full) was first seen."""

    def due(self, demands: Mapping[str, Demand], now: float) -> list[str]:
        """The lines that may step now, in the order to try them (the fair turn first)."""
        due = []
        for name, demand in demands.items():
            if demand.ready >= demand.batch_sessions:
                due.append(name)
            elif demand.ready >= demand.min_sessions:
                if now - self._partial_since.setdefault(name, now) >= demand.fill_timeout_s:
                    due.append(name)
            else:
                self._partial_since.pop(name, None)
        return sorted(due, key=lambda name: (self._last.get(name, -1), name))

    def stepped(self, name: str) -> None:
        """`name` took a step: it goes to the back of the turn."""
        self._turn += 1
        self._last[name] = self._turn
        self._partial_since.pop(name, None)
