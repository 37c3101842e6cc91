"""Several vLLM servers behind one engine: routing, backpressure, failover, rejoin.

`ReplicaSet` is an `Engine`: the gateway calls `generate` as it would on one `VLLMEngine`, and the
set picks the replica (`routing.Router`), bounds the requests outstanding on each, and survives a
replica failing:

- **backpressure**: at most `max_outstanding` requests per replica; beyond that a request waits up to
  `queue_wait_s` (at most `queue_limit` of them wait), then gets `EngineBusy` (429, `Retry-After`);
- **failover**: a replica whose connection fails is taken out at once (and by the health check when
  `/health` fails); a call that has not produced a token yet goes to another replica, a stream already
  running on it fails with a 502 (the API adapter turns it into an error event);
- **rejoin**: a replica that answers `/health` again first catches up with the version the others
  serve (`catch_up`, set by `ReplicaPublisher`), then takes calls; a replica this process started
  and that exited is started again.

Each delta carries the replica that produced it and why it was chosen (`TokenDelta.route`), and its
`version` is that replica's own: a call never records a version its replica did not serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .base import Affinity, EngineBusy, EngineError, EngineUnavailable, SamplingParams, TokenDelta
from .routing import NoReplica, Policy, Route, Router
from .vllm import VLLMEngine
from .vllm_server import VLLMServer

log = logging.getLogger(__name__)

LOST = ("engine_unavailable", "engine_connection_lost")
"""Error codes that mean the replica itself is gone (not that the request was bad)."""


@dataclass
class Replica:
    engine: VLLMEngine
    server: VLLMServer | None = None
    """Set when this process started the server, so it can start it again."""
    reason: str | None = None
    """Why the replica is out, while it is."""
    publishing: bool = False
    """Out of routing while a new version loads; calls wait for it rather than fail."""

    @property
    def url(self) -> str:
        return self.engine.base_url


@dataclass
class ReplicaEvent:
    at: float
    replica: str
    event: str
    """`down`, `up`, `restarting`, `publish_failed`."""
    detail: str = ""


@dataclass
class _Waiters:
    count: int = 0
    room: asyncio.Condition = field(default_factory=asyncio.Condition)


class ReplicaSet:
    def __init__(self, replicas: list[Replica], *, spill_at: int = 8, max_outstanding: int = 64,
                 queue_wait_s: float = 30.0, queue_limit: int = 1024, health_interval_s: float = 2.0,
                 routing: Policy = "sticky") -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = replicas
        self.model_name = replicas[0].engine.model_name
        self.router = Router(len(replicas), spill_at=spill_at, policy=routing)
        self.max_outstanding = max_outstanding
        self.queue_wait_s = queue_wait_s
        self.queue_limit = queue_limit
        self.health_interval_s = health_interval_s
        self.events: deque[ReplicaEvent] = deque(maxlen=1000)
        """Recent replica events, newest last (shown by `GET /v1/replicas`)."""
        self.restarted: Callable[[int], Awaitable[None]] | None = None
        """Told when a server this process started is started again, with its own weights (version 0)."""
        self.catch_up: Callable[[int], Awaitable[None]] | None = None
        """Brings a rejoining replica to the served version before it takes calls (ReplicaPublisher)."""
        self.fence: Callable[[], Awaitable[None]] | None = None
        """Awaited before every call is routed: a process the others may have taken for dead (its event
        loop stalled) learns what they did meanwhile before it sends anything (ReplicaSync.fence)."""
        self.canary: set[int] = set()
        """Replicas holding a full-weight canary (canary promotion): only requests that ask for its version
        go there, and those go nowhere else while one of them is in service."""
        self.canary_version: int | None = None
        self._waiters = _Waiters()
        self._health: asyncio.Task[None] | None = None

    # --- the Engine protocol -----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The newest version any replica in service serves (each call records its own replica's)."""
        serving = [r.engine.version for i, r in enumerate(self.replicas) if self.router.up[i] and i not in self.canary]
        return max(serving or [r.engine.version for i, r in enumerate(self.replicas) if i not in self.canary]
                   or [r.engine.version for r in self.replicas])

    def _behind(self, index: int) -> bool:
        """Whether a replica out of service misses a version the others serve, of the default line or a named one."""
        engine = self.replicas[index].engine
        others = [r.engine for i, r in enumerate(self.replicas) if self.router.up[i] and i != index]
        mine = engine.line_versions()
        return engine.version < self.version or any(
            version > mine.get(line, 0) for other in others for line, version in other.line_versions().items())

    def line_versions(self) -> dict[str, int]:
        """Each named policy's version as the replicas in service serve it: the oldest among them, the
        base model's 0 where one lacks it (each call records its own replica's)."""
        up = [r.engine for i, r in enumerate(self.replicas) if self.router.up[i]] or [r.engine for r in self.replicas]
        lines = {line for engine in up for line in engine.lines}
        return {line: min(engine.line_versions().get(line, 0) for engine in up) for line in lines}

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        self.start()
        if self.fence is not None:
            await self.fence()
        tried: set[int] = set()
        other_arm = self._other_arm(params.version)
        while True:
            route = await self._acquire(affinity, tried | other_arm)
            replica = self.replicas[route.replica]
            produced = False
            try:
                async for delta in replica.engine.generate(prompt_ids, params):
                    delta.route = {"replica": replica.url, "route": route.reason}
                    produced = True
                    yield delta
                return
            except EngineError as exc:
                if exc.code not in LOST:
                    raise
                self.take_out(route.replica, str(exc))
                if produced:
                    raise EngineError(f"replica {replica.url} failed during the generation: {exc}") from exc
                tried.add(route.replica)
            finally:
                self.router.finished(route.replica)
                await self._notify()

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        for replica in self.replicas:
            await replica.engine.close()

    def _other_arm(self, version: int | None) -> set[int]:
        """Replicas a request must not go to while a full-weight canary holds some of them."""
        if not self.canary:
            return set()
        if version is not None and version == self.canary_version:
            if any(self.router.up[i] for i in self.canary):
                return set(range(len(self.replicas))) - self.canary
            return set()  # no canary replica in service: the session goes on with the incumbent
        return set(self.canary)

    # --- state ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the health checks (once, from inside the event loop)."""
        if self._health is None:
            self._health = asyncio.get_running_loop().create_task(self._check_health())

    def take_out(self, index: int, reason: str) -> None:
        if self.router.up[index]:
            self.router.up[index] = False
            self.replicas[index].reason = reason
            self.record(index, "down", reason)
            log.warning("replica %s taken out: %s", self.replicas[index].url, reason)

    def drain(self, index: int, reason: str) -> None:
        """Out of routing while a new version loads into it: calls already sent finish there."""
        self.replicas[index].publishing = True
        self.take_out(index, reason)

    def bring_back(self, index: int) -> None:
        if not self.router.up[index]:
            self.router.up[index] = True
            self.replicas[index].reason = None
            self.record(index, "up")
            log.info("replica %s back in service at version %d", self.replicas[index].url,
                     self.replicas[index].engine.version)

    def state(self) -> list[dict[str, Any]]:
        return [{"replica": r.url, "up": self.router.up[i], "version": r.engine.version, "canary": i in self.canary,
                 "outstanding": self.router.outstanding[i], "reason": r.reason,
                 "self_started": r.server is not None} for i, r in enumerate(self.replicas)]

    def record(self, index: int, event: str, detail: str = "") -> None:
        self.events.append(ReplicaEvent(time.time(), self.replicas[index].url, event, detail))

    # --- backpressure ------------------------------------------------------------------------------------

    async def _acquire(self, affinity: Affinity | None, tried: set[int]) -> Route:
        """A route to a replica with room, counted as started; waits for room up to `queue_wait_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_wait_s
        waiting = False
        try:
            while True:
                full = {i for i, n in enumerate(self.router.outstanding) if n >= self.max_outstanding}
                try:
                    route = self.router.pick(affinity, exclude=tried | full)
                except NoReplica:
                    if any(r.publishing for r in self.replicas):
                        deadline = loop.time() + self.queue_wait_s  # a reload is not overload: wait it out
                    elif not any(up and i not in tried for i, up in enumerate(self.router.up)):
                        raise EngineUnavailable("no vLLM replica is available: "
                                                + "; ".join(f"{r.url}: {r.reason or 'failed this call'}"
                                                            for r in self.replicas)) from None
                else:
                    self.router.started(route.replica)
                    return route
                if not waiting:
                    if self._waiters.count >= self.queue_limit:
                        raise self._busy()
                    self._waiters.count += 1
                    waiting = True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise self._busy()
                async with self._waiters.room:
                    with contextlib.suppress(TimeoutError):
                        # Short: a replica coming back (health, reload) does not notify.
                        await asyncio.wait_for(self._waiters.room.wait(), min(remaining, 0.5))
        finally:
            if waiting:
                self._waiters.count -= 1

    def _busy(self) -> EngineBusy:
        return EngineBusy(f"every replica has {self.max_outstanding} requests outstanding and "
                          f"{self._waiters.count} more are waiting; retry shortly",
                          retry_after=max(1, round(self.queue_wait_s / 4)))

    async def _notify(self) -> None:
        if self._waiters.count:
            async with self._waiters.room:
                self._waiters.room.notify_all()

    # --- health --------------------------------------------------------------------------------------------

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check(i) for i in range(len(self.replicas))))
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, index: int) -> None:
        replica = self.replicas[index]
        if replica.publishing:
            return
        if replica.server is not None and replica.server.exited:
            self.take_out(index, f"vLLM exited ({replica.server.returncode})")
            self.record(index, "restarting")
            log.warning("replica %s exited; starting it again", replica.url)
            replica.engine.reset()  # a fresh server serves the base weights, no adapter of any line
            replica.server.launch()
            if self.restarted is not None:
                await self.restarted(index)
            return
        healthy = await replica.engine.health()
        if replica.publishing:
            # Drained while the check awaited its answer (a reload, maybe by another gateway process):
            # bringing it back now would route calls to it mid-reload, labelled with the old version.
            return
        if self.router.up[index] and not healthy:
            self.take_out(index, "health check failed")
        elif not self.router.up[index] and healthy:
            if self.catch_up is not None and self._behind(index):
                try:
                    await self.catch_up(index)
                except Exception as exc:  # stays out; the next check tries again
                    self.replicas[index].reason = f"catching up failed: {exc}"
                    self.record(index, "publish_failed", str(exc))
                    return
                if replica.publishing:  # claimed for another reload meanwhile
                    return
            self.bring_back(index)
