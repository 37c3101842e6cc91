"""New versions into serving: publish a checkpoint, follow versions published through other gateway
processes, agree full-weight reloads with them, and hand versions to the canary when promotion is on.

One lock orders every change of the served version in this process; the store records each published
version (store/promotion.py), through the store writer like every other write.

A named policy's version (`Checkpoint.line`) is published as that policy's adapter, next to the other lines
(docs/architecture.md, decision 13): at once, or under canary promotion as a canary of its own line. Versions
published through other gateway processes are followed for every line.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import Any, cast

from tracetrain.config import DEFAULT_POLICY
from tracetrain.engines.base import Engine
from tracetrain.engines.publishing import Checkpoint, LinePublisher, Publisher, PublishError, line_version
from tracetrain.engines.replica_publish import ReplicaPublisher
from tracetrain.proxy.engine_sleep import EngineSleep
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.holds import GenerationHolds
from tracetrain.proxy.promotion import Canaries
from tracetrain.proxy.replica_sync import Read, ReplicaSync
from tracetrain.store import promotion as versions
from tracetrain.store import queries
from tracetrain.store.models import utcnow
from tracetrain.store.writer import StoreWriter

log = logging.getLogger(__name__)

class PublishController:
    def __init__(self, engine: Engine, publisher: Publisher | None, *, writer: StoreWriter, read: Read,
                 holds: GenerationHolds, canaries: Canaries, engine_sleep: EngineSleep | None) -> None:
        self.engine = engine
        self.publisher = publisher
        """Puts new weights into the engine; None when this gateway does not publish (no training)."""
        self.canaries = canaries
        """Under `promotion.mode: canary`, each line's new versions serve a share of its new sessions until their
        test decides."""
        self.replica_sync: ReplicaSync | None = None
        """Full-weight reloads agreed with the other gateway processes on the store (proxy/replica_sync.py)."""
        self._writer, self._read, self._holds, self._engine_sleep = writer, read, holds, engine_sleep
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._notes: set[asyncio.Task[Any]] = set()
        self._newest_served: dict[str, int] = {}
        """The newest version of each line this process has recorded a call of (see `note_served`)."""

    async def start(self) -> None:
        await self._start_replica_sync()
        if self.canaries.enabled:
            self._tasks.append(asyncio.create_task(self.canaries.run()))
        else:
            self._tasks.append(asyncio.create_task(self._follow_versions()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.replica_sync is not None:
            await self.replica_sync.stop()

    async def publish(self, checkpoint: Checkpoint) -> None:
        """Hand a checkpoint to the engine; on failure the engine keeps serving the old version."""
        if self.publisher is None:
            raise APIError(409, "This gateway has no publisher configured (start it with --train or set "
                           "train.publish).", code="no_publisher")
        if checkpoint.line != DEFAULT_POLICY:
            await self._publish_line(checkpoint)
            return
        async with self._lock:
            if checkpoint.version <= self.engine.version:
                raise APIError(409, f"Version {checkpoint.version} is not newer than the served version "
                               f"{self.engine.version}.", code="stale_version")
            self._refuse_second_canary(checkpoint)
            try:
                async with self._awake():
                    await self._load(checkpoint)
            finally:
                await self._record_probes(checkpoint)

    def _awake(self) -> AbstractAsyncContextManager[None]:
        """Loading an adapter or reloading weights needs them on the GPU, and the probe an engine that answers."""
        return self._engine_sleep.awake() if self._engine_sleep is not None else nullcontext()

    def _refuse_second_canary(self, checkpoint: Checkpoint) -> None:
        trial = self.canaries.line(checkpoint.line).trial if self.canaries.enabled else None
        if trial is not None:
            of = "" if checkpoint.line == DEFAULT_POLICY else f" of policy '{checkpoint.line}'"
            raise APIError(409, f"Version {trial.checkpoint.version}{of} is still a canary: promote or roll it "
                           "back first.", code="canary_on_trial")

    async def _record_probes(self, checkpoint: Checkpoint) -> None:
        """The publish probe's figures by replica, on the version's row, whether the publish held or not."""
        if probes := getattr(self.publisher, "probes", {}).get((checkpoint.line, checkpoint.version)):
            await self._writer.submit(lambda db: versions.record_probes(
                db, version=checkpoint.version, probes=probes, line=checkpoint.line))

    async def _publish_line(self, checkpoint: Checkpoint) -> None:
        """A named policy's version, served at once to that policy's requests."""
        publish_line = getattr(self.publisher, "publish_line", None)
        if publish_line is None:
            raise APIError(409, f"This gateway's publisher cannot serve named policies' adapters (policy "
                           f"'{checkpoint.line}').", code="no_publisher")
        if checkpoint.kind != "lora":
            raise APIError(409, f"Policy '{checkpoint.line}' is a line of LoRA adapters; got a {checkpoint.kind} "
                           "checkpoint.", code="stale_version")
        async with self._lock:
            served = line_version(self.engine, checkpoint.line)
            if checkpoint.version <= served:
                raise APIError(409, f"Version {checkpoint.version} of policy '{checkpoint.line}' is not newer than "
                               f"its served version {served}.", code="stale_version")
            self._refuse_second_canary(checkpoint)
            try:
                async with self._awake():
                    if self.canaries.enabled:
                        await self.canaries.line(checkpoint.line).stage(checkpoint)
                        return
                    await cast(LinePublisher, self.publisher).publish_line(checkpoint)
            finally:
                await self._record_probes(checkpoint)
        await self._writer.submit(lambda db: versions.mark_published(
            db, version=checkpoint.version, checkpoint=checkpoint.path, kind=checkpoint.kind, promotion="immediate",
            line=checkpoint.line))

    def note_served(self, version: int, line: str = DEFAULT_POLICY) -> None:
        """A call of `line`'s `version` was recorded: the first one of a version newer than any this process
        served dates the version's first call (`Policy.first_call_at`; a no-op if another process got there
        first)."""
        if version <= self._newest_served.get(line, -1):
            return
        self._newest_served[line] = version
        at = utcnow()
        task = asyncio.create_task(self._writer.submit(lambda db: versions.record_first_call(
            db, version=version, at=at, line=line)))
        self._notes.add(task)
        task.add_done_callback(self._notes.discard)

    async def _load(self, checkpoint: Checkpoint) -> None:
        assert self.publisher is not None
        if self.canaries.enabled:
            await self.canaries.default.stage(checkpoint)
            return
        # A publisher that pauses the engine (in-place reload) would let requests sent meanwhile
        # run on the new weights under the old label: hold new generations instead.
        pauses = getattr(self.publisher, "pauses_engine", False)
        if pauses:
            self._holds.hold("publish")
        try:
            await self.publisher.publish(checkpoint)
            served_at = utcnow()  # before the write queue: calls on the new version may be recorded first
        finally:
            if pauses:
                self._holds.release("publish")
        await self._writer.submit(lambda db: versions.mark_published(
            db, version=checkpoint.version, checkpoint=checkpoint.path, kind=checkpoint.kind,
            promotion="immediate", at=served_at))

    async def _start_replica_sync(self) -> None:
        """Full weights reloaded in place: every gateway process on this store labels each replica's calls
        with the weights the store records for it, and reloads wait for the others to stop sending."""
        publisher = self.publisher
        if not (isinstance(publisher, ReplicaPublisher) and publisher.reloads_in_place):
            return
        sync = ReplicaSync(publisher.replicas, read=self._read, write=self._writer.submit,
                           base_weights=publisher.base_weights, restore=publisher.restore)
        publisher.coordinator = sync
        await sync.start()
        self.replica_sync = sync
        self._tasks.append(asyncio.create_task(sync.run()))

    async def _follow_versions(self, interval_s: float = 1.0) -> None:
        """Serve each line's newest version a trainer published through another gateway process on this store
        (`serve --workers N`, several gateway hosts): the trainer marks it published in the store."""
        adopt = getattr(self.publisher, "adopt", None)
        if adopt is None:
            return
        given_up: set[tuple[str, int]] = set()
        """Versions that could not be served here (their checkpoint gone, say): the next one is followed."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                for line, latest in (await self._read(queries.latest_published_by_line)).items():
                    if (latest.checkpoint is None or latest.version <= line_version(self.engine, line)
                            or (line, latest.version) in given_up):
                        continue
                    async with self._lock:
                        if latest.version <= line_version(self.engine, line):
                            continue  # a publish through this process got there first
                        failure = "not loaded"
                        try:
                            async with self._awake():  # a restarted gateway may catch up while a step holds
                                await adopt(Checkpoint(latest.version, Path(latest.checkpoint), latest.kind, line))
                        except PublishError as exc:
                            failure = str(exc)
                        if latest.version <= line_version(self.engine, line):
                            log.info("serving version %d of line %r, published through another gateway process "
                                     "or before this one started", latest.version, line)
                            continue
                        given_up.add((line, latest.version))
                        log.error("version %d of line %r is published but this gateway could not serve it (%s); "
                                  "it serves version %d until the next one", latest.version, line, failure,
                                  line_version(self.engine, line))
            except Exception as exc:  # the store or an engine briefly away: try again next round
                log.warning("following the published version failed: %s", exc)
