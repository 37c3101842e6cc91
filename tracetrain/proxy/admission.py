"""Staleness-aware admission: hold new sessions while the trainer already has enough work.

Under `gateway.admission: staleness` a request that would start a new session waits while the sessions that
are ready for the trainer (final, unclaimed; counted in the store, so a trainer in any process frees
room by claiming) plus the sessions this gateway admitted and that are still running fill
`admission_limit`. Room appears as the trainer claims a batch; a request still waiting after
`gateway.admission_wait_s` gets 429 with `Retry-After` (the trainer's recent step interval). Calls of
sessions already running are never held, nor are siblings of an explicit group admitted moments
ago (a GRPO group is admitted whole), nor requests marked `X-Admission: bypass` (evaluation).

Each named policy is admitted on its own: its ready and running sessions against its own limit (from its
own `batch_sessions` where it sets one), with its own step interval in `Retry-After`. The trainer steps
each policy on its own batches, so one policy's backlog says nothing about another's staleness, and a busy
policy must not hold a quiet one's agents.

The same bound as AReaL's `max_head_offpolicyness` (Fu et al. 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning"), counted per batch of ready
plus in-flight sessions rather than cumulatively, and tighter by default: our trainer takes the
freshest sessions first, so anything admitted beyond one batch ages while newer work is preferred.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from cachetools import TTLCache
from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session

from tracetrain.config import Config
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.metrics import GatewayMetrics
from tracetrain.store import leases, policy_lines
from tracetrain.store.models import DEFAULT_POLICY

POLL_S = 0.25
"""How often held requests look for room (one store count per interval, shared by all of them)."""
SIBLING_WINDOW_S = 10.0
"""Members of an explicit group arriving this soon after its first admitted member are admitted too."""
MAX_TRACKED = 1_000_000


@dataclass(frozen=True)
class _Count:
    ready: int
    limit: int
    retry_after: int
    at: float


class Admission:
    def __init__(self, config: Config, db: DBEngine, metrics: GatewayMetrics) -> None:
        self.enabled = config.gateway.admission == "staleness"
        self.config = config
        self.wait_s = config.gateway.admission_wait_s
        self.db = db
        self.metrics = metrics
        self.in_flight: dict[str, TTLCache[str, bool]] = {}
        """Per policy: sessions admitted here and not final; one idle for `group_settle_s` counts as abandoned."""
        self.groups: TTLCache[str, bool] = TTLCache(MAX_TRACKED, ttl=SIBLING_WINDOW_S)
        self._counts: dict[str, _Count] = {}
        self._lock = asyncio.Lock()

    async def admit(self, session_id: str, group_id: str | None, *, policy: str = DEFAULT_POLICY,
                    bypass: bool = False) -> None:
        """Return once a new session of `policy` may start; raise 429 after `gateway.admission_wait_s` without
        room."""
        if not self.enabled or bypass or self._running(session_id) is not None:
            return
        deadline = time.monotonic() + self.wait_s
        self.metrics.admission_held.inc()
        try:
            while not (group_id in self.groups or await self._room(policy)):
                if time.monotonic() >= deadline:
                    self.metrics.admission_refused.inc()
                    count = self._counts[policy]
                    whose = "" if policy == DEFAULT_POLICY else f" of policy '{policy}'"
                    raise APIError(429, f"The trainer has {count.limit} sessions{whose} ready or running already "
                                   f"(admission: staleness); retry in about {count.retry_after} s.",
                                   code="admission_full", headers={"Retry-After": str(count.retry_after)})
                await asyncio.sleep(POLL_S)
        finally:
            self.metrics.admission_held.dec()
        self._flying(policy)[session_id] = True
        if group_id is not None:
            self.groups.setdefault(group_id, True)

    def touch(self, session_id: str) -> None:
        """A later call of a session: it is still running."""
        if (policy := self._running(session_id)) is not None:
            self.in_flight[policy][session_id] = True

    def finished(self, session_id: str) -> None:
        """Its final reward is stored: it now counts as ready (read fresh from the store next time)."""
        if (policy := self._running(session_id)) is not None:
            self.in_flight[policy].pop(session_id, None)
            self._counts.pop(policy, None)

    def _running(self, session_id: str) -> str | None:
        """The policy of a session admitted here and still running, or None."""
        return next((policy for policy, flying in self.in_flight.items() if session_id in flying), None)

    def _flying(self, policy: str) -> TTLCache[str, bool]:
        if policy not in self.in_flight:
            self.in_flight[policy] = TTLCache(MAX_TRACKED, ttl=self.config.train.group_settle_s)
        return self.in_flight[policy]

    async def _room(self, policy: str) -> bool:
        async with self._lock:
            count = self._counts.get(policy)
            if count is None or time.monotonic() - count.at >= POLL_S:
                count = self._counts[policy] = await asyncio.to_thread(self._count, policy)
        # No await between this check and the caller's insert: concurrent waiters cannot overshoot.
        return count.ready + len(self._flying(policy)) < count.limit

    def _count(self, policy: str) -> _Count:
        with Session(self.db) as db:
            ready = leases.ready_count(db, policy=policy)
            times = leases.recent_policy_times(db, limit=6, line=policy)
            line = policy_lines.get(db, name=policy) if policy != DEFAULT_POLICY else None
        batch = (line.settings if line is not None else {}).get("batch_sessions", self.config.train.batch_sessions)
        limit = self.config.admission_limit_for(int(batch))
        steps = [(a - b).total_seconds() for a, b in zip(times, times[1:], strict=False)]
        retry_after = max(1, min(60, round(sum(steps) / len(steps)))) if steps else 5
        return _Count(ready, limit, retry_after, time.monotonic())
