"""Full-weight reloads agreed between the gateway processes on one store (store/replica_states.py).

Each process runs one `ReplicaSync`. It is the `ReloadCoordinator` of its own `ReplicaPublisher`
(claim the replica, wait until every other live process acknowledged, reload, record the version) and
it follows the other processes' reloads (`run`, every `interval_s`):

- another process claimed a replica: take it out of routing (calls wait for it, or go to another
  replica), and once none of this process's calls are outstanding there, acknowledge;
- the reload finished: label the replica with the version the store records, then route to it again;
  a failed one stays out until its health check brings it back;
- a claim lapsed (its owner died mid-reload): the replica's weights are unknown, so one process claims it
  and reloads the weights the store last recorded for it, before anyone routes to it.

A replica's label always comes from the store, so a process started after a reload, or one that missed
it, labels its calls with the weights the replica holds. A process whose event loop stalled for longer
than `liveness_s` may have been taken for dead and a reload done without its acknowledgement: before it
routes a call (`fence`), a process whose last heartbeat and poll are older than half that window
heartbeats and polls again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tracetrain.engines.publishing import Checkpoint, PublishError
from tracetrain.engines.replicas import ReplicaSet
from tracetrain.store import replica_states
from tracetrain.store.models import ReplicaState

log = logging.getLogger(__name__)

Read = Callable[[Callable[[Any], Any]], Awaitable[Any]]
"""Runs a read-only store query (Gateway.read)."""
Write = Callable[[Callable[[Any], Any]], Awaitable[Any]]
"""Runs a store write in its own committed transaction (StoreWriter.submit)."""
Restore = Callable[[int, Checkpoint], Awaitable[None]]
"""Reloads one replica with known weights and puts it back (ReplicaPublisher.restore)."""


def process_id() -> str:
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class ReplicaSync:
    def __init__(self, replicas: ReplicaSet, *, read: Read, write: Write, base_weights: Path,
                 restore: Restore | None = None, interval_s: float = 0.25, heartbeat_s: float = 1.0,
                 liveness_s: float = 10.0, lease_s: float = 30.0, drain_timeout_s: float = 600.0) -> None:
        self.replicas = replicas
        self.read = read
        self.write = write
        self.base_weights = base_weights
        """The servers' own model: what a replica holds at version 0."""
        self.restore = restore
        self.process = process_id()
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.liveness_s = liveness_s
        """A process whose heartbeat is older than this is taken for dead: reloads stop waiting for it."""
        self.lease_s = lease_s
        self.drain_timeout_s = drain_timeout_s
        """How long a reload waits for the other processes' calls on the replica to finish."""
        self._stood_aside: dict[int, int] = {}
        """Replica index -> the other process's claim (epoch) this process took it out of routing for."""
        self._acknowledged: set[tuple[str, int]] = set()
        self._renewals: dict[str, asyncio.Task[None]] = {}
        self._claims: dict[str, int] = {}
        self._repairs: dict[int, asyncio.Task[None]] = {}
        self._confirmed_at = float("-inf")
        """Loop time of the last heartbeat followed by a poll: until then this process was alive to the
        others, and it has seen what they claimed."""
        self._confirming = asyncio.Lock()
        # The replica set's hooks: before each call is routed, and when a server it started restarts.
        replicas.fence = self.fence
        replicas.restarted = self.reset

    # --- following the other processes ---------------------------------------------------------------

    async def start(self) -> None:
        """Register and take the store's record of every replica's weights before the first call."""
        await self._beat_and_sync()

    async def stop(self) -> None:
        for task in [*self._renewals.values(), *self._repairs.values()]:
            task.cancel()
        try:
            await self.write(lambda db: replica_states.forget_process(db, process=self.process))
        except Exception as exc:  # the store away at shutdown: the heartbeat lapses by itself
            log.warning("unregistering gateway process %s failed: %s", self.process, exc)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if loop.time() - self._confirmed_at >= self.heartbeat_s:
                    await self._beat_and_sync()
                else:
                    await self.sync_once()
            except Exception as exc:  # the store briefly away: keep every replica as it is, try again
                log.warning("following the replicas' weights in the store failed: %s", exc)

    async def fence(self) -> None:
        """Before a call is routed: return at once, unless this process's heartbeat is old enough that
        the others may have stopped waiting for it (its loop stalled); then heartbeat and poll first."""
        if asyncio.get_running_loop().time() - self._confirmed_at <= self.liveness_s / 2:
            return
        async with self._confirming:
            if asyncio.get_running_loop().time() - self._confirmed_at > self.liveness_s / 2:
                log.warning("gateway process %s was silent for over %.0f s; following the store before routing",
                            self.process, self.liveness_s / 2)
                await self._beat_and_sync()

    async def _beat_and_sync(self) -> None:
        beat = asyncio.get_running_loop().time()
        await self.write(lambda db: replica_states.heartbeat(db, process=self.process))
        await self.sync_once()
        self._confirmed_at = beat

    async def sync_once(self) -> None:
        states: dict[str, ReplicaState] = await self.read(replica_states.states)
        for index, replica in enumerate(self.replicas.replicas):
            state = states.get(replica.url)
            if state is None or state.owner == self.process:
                continue
            lapsed = replica_states.claim_lapsed(state)
            if state.reloading_to is not None and not lapsed:
                await self._stand_aside(index, state)
            elif lapsed:
                self._start_repair(index, state)
            elif index in self._stood_aside:
                self._rejoin(index, state)
            elif not replica.publishing and replica.engine.version != state.version:
                # Started after a reload, or the replica restarted: the store knows what it holds.
                replica.engine.use_adapter(None, state.version)
                log.info("replica %s holds version %d (recorded in the store)", replica.url, state.version)

    async def _stand_aside(self, index: int, state: ReplicaState) -> None:
        """Another process reloads this replica: send it nothing, and say so once nothing is outstanding."""
        if self._stood_aside.get(index) != state.epoch:
            self.replicas.drain(index, f"version {state.reloading_to} loading through gateway process {state.owner}")
            self._stood_aside[index] = state.epoch
        key = (state.url, state.epoch)
        if self.replicas.router.outstanding[index] == 0 and key not in self._acknowledged:
            await self.write(lambda db: replica_states.acknowledge(db, url=state.url, epoch=state.epoch,
                                                                    process=self.process))
            self._acknowledged.add(key)

    def _rejoin(self, index: int, state: ReplicaState) -> None:
        """The reload this process stood aside for is over: label first, then route to it again."""
        epoch = self._stood_aside.pop(index)
        self._acknowledged.discard((state.url, epoch))
        replica = self.replicas.replicas[index]
        replica.engine.use_adapter(None, state.version)
        replica.publishing = False
        if state.failure:  # out already (it was drained): say why; its health check brings it back
            replica.reason = f"a reload through another gateway process failed: {state.failure}"
            self.replicas.record(index, "publish_failed", state.failure)
        else:
            self.replicas.bring_back(index)

    def _start_repair(self, index: int, state: ReplicaState) -> None:
        """The process reloading this replica died: its weights are unknown until reloaded."""
        self.replicas.drain(index, f"a reload by gateway process {state.owner} was not finished (it stopped)")
        self._stood_aside.pop(index, None)
        if self.restore is not None and index not in self._repairs:
            self._repairs[index] = asyncio.create_task(self._repair(index, state))
            self._repairs[index].add_done_callback(lambda _: self._repairs.pop(index, None))

    async def _repair(self, index: int, state: ReplicaState) -> None:
        replica = self.replicas.replicas[index]
        assert self.restore is not None
        path = Path(state.checkpoint) if state.checkpoint else self.base_weights
        log.warning("replica %s: reloading version %d, the last weights recorded for it", replica.url, state.version)
        try:
            await self.restore(index, Checkpoint(state.version, path, "full"))
        except PublishError as exc:  # another process took the repair, or it failed: the next round sees
            log.warning("repairing replica %s: %s", replica.url, exc)

    # --- the ReloadCoordinator of this process's publisher ------------------------------------------

    async def begin_reload(self, url: str, version: int, *, forward_only: bool = False) -> int | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while True:
            states: dict[str, ReplicaState] = await self.read(replica_states.states)
            state = states.get(url)
            busy = state is not None and state.reloading_to is not None and not replica_states.claim_lapsed(state)
            there = state is not None and (state.version >= version if forward_only else state.version == version)
            if there and not busy and state is not None and state.owner is None:
                return state.version  # another process already brought it there (or past it)
            if not busy:
                epoch = await self.write(lambda db: replica_states.claim_reload(
                    db, url=url, version=version, owner=self.process, ttl_s=self.lease_s))
                if epoch is not None:
                    break
            if loop.time() > deadline:
                raise PublishError(f"{url} is being reloaded by gateway process {state.owner if state else '?'}")
            await asyncio.sleep(self.interval_s)
        self._claims[url] = epoch
        self._renewals[url] = asyncio.create_task(self._renew(url, epoch))
        while True:
            live = set(await self.read(lambda db: replica_states.live_processes(db, within_s=self.liveness_s)))
            acked = await self.read(lambda db: replica_states.acknowledged_by(db, url=url, epoch=epoch))
            waiting = live - acked - {self.process}
            if not waiting:
                return None
            if loop.time() > deadline:
                message = f"gateway processes {sorted(waiting)} did not stop sending to {url} in time"
                await self.end_reload(url, None, None, message)
                raise PublishError(message)
            await asyncio.sleep(self.interval_s / 2)

    async def end_reload(self, url: str, version: int | None, checkpoint: Path | None, failure: str | None) -> None:
        epoch = self._claims.pop(url)
        renewal = self._renewals.pop(url, None)
        if renewal is not None:
            renewal.cancel()
        path = str(checkpoint) if checkpoint is not None else None
        await self.write(lambda db: replica_states.finish_reload(db, url=url, epoch=epoch, version=version,
                                                                 checkpoint=path, failure=failure))

    async def _renew(self, url: str, epoch: int) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                renewed = await self.write(lambda db: replica_states.renew_claim(db, url=url, epoch=epoch,
                                                                                 ttl_s=self.lease_s))
            except Exception as exc:
                log.warning("renewing the reload claim on %s failed: %s", url, exc)
                continue
            if not renewed:
                log.error("the reload claim on %s lapsed and was taken over", url)
                return

    async def reset(self, index: int) -> None:
        """A replica restarted with its server's own weights (ReplicaSet.restarted)."""
        url = self.replicas.replicas[index].url
        try:
            await self.write(lambda db: replica_states.reset(db, url=url))
        except Exception as exc:  # the label is 0 here already; the store catches up at the next restart
            log.warning("recording that replica %s restarted failed: %s", url, exc)
