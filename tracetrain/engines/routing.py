"""Which replica serves a call: sticky by session, least-loaded for new sessions, spill when overloaded.

A session's later calls repeat its earlier prompt, which the replica that served it holds in its
prefix cache; sending them elsewhere recomputes the whole prefix (prime-rl reported the cache hit rate
collapsing without affinity; bench/results/replicas.md compares sticky and round-robin here). So:

- a session goes back to the replica that served its previous call (`sticky`);
- a new session goes where its group already is (`group`: GRPO siblings share a prompt), else to the
  replica with the fewest outstanding requests (`least_loaded`, ties rotated so idle replicas share);
- a session whose replica has `spill_at` or more outstanding requests while another has fewer moves
  to the least loaded one (`spill`); one whose replica is out moves too (`failover`); either way it
  stays on its new replica afterwards, where its prefix now is.

Pure bookkeeping, no I/O: `replicas.py` counts requests in and out and marks replicas up and down.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from cachetools import LRUCache

from .base import Affinity

Reason = Literal["sticky", "group", "least_loaded", "spill", "failover", "round_robin"]
Policy = Literal["sticky", "round_robin"]


@dataclass(frozen=True)
class Route:
    replica: int
    reason: Reason


class NoReplica(Exception):
    """No replica is up (or every one was excluded)."""


class Router:
    def __init__(self, replicas: int, *, spill_at: int, policy: Policy = "sticky", remembered: int = 100_000) -> None:
        self.policy = policy
        """`round_robin` ignores sessions and load (the baseline affinity is measured against)."""
        self.outstanding = [0] * replicas
        """Requests sent to each replica and not finished."""
        self.up = [True] * replicas
        self.spill_at = spill_at
        self._sessions: LRUCache[str, int] = LRUCache(remembered)
        self._groups: LRUCache[str, int] = LRUCache(remembered)
        self._turn = 0

    def pick(self, affinity: Affinity | None, *, exclude: Collection[int] = ()) -> Route:
        """Where the next call goes; raises NoReplica when no replica is up outside `exclude`."""
        candidates = [i for i, up in enumerate(self.up) if up and i not in exclude]
        if not candidates:
            raise NoReplica
        if self.policy == "round_robin":
            self._turn = (self._turn + 1) % len(self.up)
            return Route(min(candidates, key=lambda i: (i - self._turn) % len(self.up)), "round_robin")
        least = self._least_loaded(candidates)
        if affinity is None:
            return Route(least, "least_loaded")
        pinned = self._sessions.get(affinity.session_id)
        if pinned is not None:
            if pinned not in candidates:
                return self._pin(affinity, Route(least, "failover"))
            if self._overloaded(pinned, least):
                return self._pin(affinity, Route(least, "spill"))
            return self._pin(affinity, Route(pinned, "sticky"))
        grouped = self._groups.get(affinity.group_id) if affinity.group_id else None
        if grouped is not None and grouped in candidates and not self._overloaded(grouped, least):
            return self._pin(affinity, Route(grouped, "group"))
        return self._pin(affinity, Route(least, "least_loaded"))

    def started(self, replica: int) -> None:
        self.outstanding[replica] += 1

    def finished(self, replica: int) -> None:
        self.outstanding[replica] -= 1

    def _overloaded(self, replica: int, least: int) -> bool:
        return self.outstanding[replica] >= self.spill_at and self.outstanding[least] < self.outstanding[replica]

    def _least_loaded(self, candidates: list[int]) -> int:
        # Rotating the start makes ties go round: at low load every idle replica gets new sessions.
        self._turn = (self._turn + 1) % len(self.up)
        ordered = sorted(candidates, key=lambda i: (self.outstanding[i], (i - self._turn) % len(self.up)))
        return ordered[0]

    def _pin(self, affinity: Affinity, route: Route) -> Route:
        self._sessions[affinity.session_id] = route.replica
        if affinity.group_id and (route.reason != "group"):
            self._groups[affinity.group_id] = route.replica
        return route
