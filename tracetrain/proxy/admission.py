"""Staleness-aware admission: hold new sessions while the trainer already has enough work.

Under `gateway.admission: staleness` a request that would start a new session waits while the sessions that
are ready for the trainer (final, unclaimed; counted in the store, so a trainer in any process frees
room by claiming) plus the sessions this gateway admitted and that are still running fill
`admission_limit`. Room appears as the trainer claims a batch; a request still waiting after
`gateway.admission_wait_s` gets 429 with `Retry-After` (the trainer's recent step interval). Calls of
sessions already running are never held, nor are siblings of an explicit group admitted moments
ago (a GRPO group is admitted whole), nor requests marked `X-Admission: bypass` (evaluation).

The same bound as AReaL's `max_head_offpolicyness` (Fu et al. 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning"), counted per batch of ready
plus in-flight sessions rather than cumulatively, and tighter by default: our trainer takes the
freshest sessions first, so anything admitted beyond one batch ages while newer work is preferred.
"""

from __future__ import annotations

import asyncio
import math
import time

from cachetools import TTLCache
from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session

from tracetrain.config import Config
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.metrics import GatewayMetrics
from tracetrain.store import leases

POLL_S = 0.25
"""How often held requests look for room (one store count per interval, shared by all of them)."""
SIBLING_WINDOW_S = 10.0
"""Members of an explicit group arriving this soon after its first admitted member are admitted too."""
MAX_TRACKED = 1_000_000


class Admission:
    def __init__(self, config: Config, db: DBEngine, metrics: GatewayMetrics) -> None:
        self.enabled = config.gateway.admission == "staleness"
        self.limit = config.admission_limit
        self.wait_s = config.gateway.admission_wait_s
        self.db = db
        self.metrics = metrics
        self.in_flight: TTLCache[str, bool] = TTLCache(MAX_TRACKED, ttl=config.train.group_settle_s)
        """Sessions admitted here and not final; one idle for `group_settle_s` counts as abandoned."""
        self.groups: TTLCache[str, bool] = TTLCache(MAX_TRACKED, ttl=SIBLING_WINDOW_S)
        self._ready = 0
        self._ready_at = -math.inf
        self._retry_after = 5
        self._lock = asyncio.Lock()

    async def admit(self, session_id: str, group_id: str | None, *, bypass: bool = False) -> None:
        """Return once a new session may start; raise 429 after `gateway.admission_wait_s` without room."""
        if not self.enabled or bypass or session_id in self.in_flight:
            return
        deadline = time.monotonic() + self.wait_s
        self.metrics.admission_held.inc()
        try:
            while not (group_id in self.groups or await self._room()):
                if time.monotonic() >= deadline:
                    self.metrics.admission_refused.inc()
                    raise APIError(429, f"The trainer has {self.limit} sessions ready or running already "
                                   f"(admission: staleness); retry in about {self._retry_after} s.",
                                   code="admission_full", headers={"Retry-After": str(self._retry_after)})
                await asyncio.sleep(POLL_S)
        finally:
            self.metrics.admission_held.dec()
        self.in_flight[session_id] = True
        if group_id is not None:
            self.groups.setdefault(group_id, True)

    def touch(self, session_id: str) -> None:
        """A later call of a session: it is still running."""
        if session_id in self.in_flight:
            self.in_flight[session_id] = True

    def finished(self, session_id: str) -> None:
        """Its final reward is stored: it now counts as ready (read fresh from the store next time)."""
        if self.in_flight.pop(session_id, None) is not None:
            self._ready_at = -math.inf

    async def _room(self) -> bool:
        async with self._lock:
            if time.monotonic() - self._ready_at >= POLL_S:
                self._ready, self._retry_after = await asyncio.to_thread(self._count)
                self._ready_at = time.monotonic()
        # No await between this check and the caller's insert: concurrent waiters cannot overshoot.
        return self._ready + len(self.in_flight) < self.limit

    def _count(self) -> tuple[int, int]:
        with Session(self.db) as db:
            ready = leases.ready_count(db)
            times = leases.recent_policy_times(db, limit=6)
        steps = [(a - b).total_seconds() for a, b in zip(times, times[1:], strict=False)]
        return ready, max(1, min(60, round(sum(steps) / len(steps)))) if steps else 5
