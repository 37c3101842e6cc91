"""The gateway's shared state: engine, renderer, store writer, chain cache, keys and metrics."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session

from tracetrain.config import Config
from tracetrain.engines.base import Engine
from tracetrain.engines.publishing import CanaryPublisher, Checkpoint, Publisher
from tracetrain.engines.replica_publish import ReplicaPublisher
from tracetrain.engines.replicas import ReplicaSet
from tracetrain.proxy.admission import Admission
from tracetrain.proxy.auth import KeyRing
from tracetrain.proxy.chain import ChainCache, ChainNode
from tracetrain.proxy.engine_sleep import EngineSleep
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.gate import GenerationGate, mirror_store_holds
from tracetrain.proxy.metrics import GatewayMetrics
from tracetrain.proxy.promotion import Promotion
from tracetrain.proxy.render import ChatRenderer
from tracetrain.proxy.replica_sync import ReplicaSync
from tracetrain.store import holds, promotion, queries, search_index
from tracetrain.store.messages import full_messages
from tracetrain.store.models import utcnow
from tracetrain.store.trajectory import full_ids
from tracetrain.store.writer import StoreWriter

log = logging.getLogger(__name__)

SESSION_CACHE = 100_000
LATEST = "latest"
"""Chain-cache key of a session's latest text-completion call (other keys are 64-hex state hashes)."""


@dataclass
class SessionState:
    """What never changes about a stored session: safe to cache in every gateway process."""

    owner: str | None
    group_id: str
    version: int | None = None
    """The policy version its first call was served by (canary promotion keeps the session on it)."""


class Gateway:
    def __init__(self, config: Config, engine: Engine, tokenizer: Any, db: DBEngine) -> None:
        self.config = config
        self.engine = engine
        template = config.chat_template.read_text() if config.chat_template else None
        self.renderer = ChatRenderer(tokenizer, template=template)
        self.db = db
        self._inline_reads = db.dialect.name == "sqlite"
        """Point lookups on the event loop: a local SQLite primary-key read (never blocked by a writer
        in WAL mode) costs less than the hop to a worker thread and back (two context switches); a
        PostgreSQL read is a network round trip and takes the thread."""
        self.requests_in_flight = 0
        """HTTP requests in progress, a stream until its last byte (counted by proxy/app.py's `InFlight`)."""
        # Alone on the event loop, a commit there costs less than the hop to the writer's thread.
        self.writer = StoreWriter(db, inline=lambda: self.requests_in_flight <= 1)
        self.chains = ChainCache()
        self.keys = KeyRing(config.api_keys, config.admin_key)
        self.metrics = GatewayMetrics()
        self.metrics.queue_depth.set_function(lambda: self.writer.queue_depth)
        self.metrics.policy_version.set_function(lambda: self.engine.version)
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        """Recently used stored sessions: saves a read per call and numbers calls without a query."""
        self.publisher: Publisher | None = None
        """Puts new weights into the engine; set when training is on (see cli.py)."""
        self.admission = Admission(config, db, self.metrics)
        """Under `admission: staleness`, holds new sessions while the trainer has enough work."""
        self.gate = GenerationGate()
        """Closed while a `sync`-mode training step runs or the engine reloads weights."""
        self.promotion = Promotion(config, engine, db)
        """Under `promotion: canary`, new versions serve a share of new sessions until their test decides."""
        self.replica_sync: ReplicaSync | None = None
        """Full-weight reloads agreed with the other gateway processes on the store (proxy/replica_sync.py)."""
        self._publish_lock = asyncio.Lock()
        self._replica_follower: asyncio.Task[None] | None = None
        self.engine_sleep = (EngineSleep(self.gate, engine) if config.engine_sleep == "on"
                             and isinstance(engine, ReplicaSet) else None)
        """vLLM asleep during `sync`-mode steps on a GPU it shares with the trainer (proxy/engine_sleep.py)."""
        self._sleeper: asyncio.Task[None] | None = None
        self._newest_served = -1
        """The newest version this process has recorded a call of (see `note_served`)."""
        self._notes: set[asyncio.Task[Any]] = set()
        self._holds: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._indexer: asyncio.Task[None] | None = None
        self.services: list[Any] = []
        """Background services started and stopped with the gateway (the trainer thread)."""

    async def start(self) -> None:
        await self.writer.start()
        if hasattr(self.engine, "start"):  # a replica set's health checks
            self.engine.start()
        await self._start_replica_sync()
        self._holds = asyncio.create_task(mirror_store_holds(self.gate, lambda: self.read(holds.active_holders)))
        if self.promotion.enabled:
            self.promotion.publisher = cast(CanaryPublisher | None, self.publisher)
            self._follower = asyncio.create_task(self.promotion.run())
        else:
            self._follower = asyncio.create_task(self._follow_versions())
        self._indexer = asyncio.create_task(self._index_search())
        if self.engine_sleep is not None:
            self._sleeper = asyncio.create_task(self.engine_sleep.run())
        for service in self.services:
            service.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        for task in (self._holds, self._follower, self._indexer, self._replica_follower, self._sleeper):
            if task is not None:
                task.cancel()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        for service in reversed(self.services):
            await asyncio.to_thread(service.stop)
        await self.writer.stop()
        await self.engine.close()

    async def _start_replica_sync(self) -> None:
        """Full weights reloaded in place: every gateway process on this store labels each replica's calls
        with the weights the store records for it, and reloads wait for the others to stop sending."""
        publisher = self.publisher
        if not (isinstance(publisher, ReplicaPublisher) and publisher.reloads_in_place):
            return
        sync = ReplicaSync(publisher.replicas, read=self.read, write=self.writer.submit,
                           base_weights=publisher.base_weights, restore=publisher.restore)
        publisher.coordinator = sync
        await sync.start()
        self.replica_sync = sync
        self._replica_follower = asyncio.create_task(sync.run())

    async def publish(self, checkpoint: Checkpoint) -> None:
        """Hand a checkpoint to the engine; on failure the engine keeps serving the old version."""
        if self.publisher is None:
            raise APIError(409, "This gateway has no publisher configured (start it with --train or set "
                           "train.publish).", code="no_publisher")
        async with self._publish_lock:
            if checkpoint.version <= self.engine.version:
                raise APIError(409, f"Version {checkpoint.version} is not newer than the served version "
                               f"{self.engine.version}.", code="stale_version")
            if self.engine_sleep is not None:
                await self.engine_sleep.wake()  # loading an adapter or reloading weights needs them on the GPU
            if self.promotion.enabled and self.promotion.trial is not None:
                raise APIError(409, f"Version {self.promotion.trial.checkpoint.version} is still a canary: "
                               "promote or roll it back first.", code="canary_on_trial")
            try:
                await self._load(checkpoint)
            finally:
                if probes := getattr(self.publisher, "probes", {}).get(checkpoint.version):
                    await self.writer.submit(lambda db: promotion.record_probes(db, version=checkpoint.version,
                                                                                probes=probes))

    async def _load(self, checkpoint: Checkpoint) -> None:
        assert self.publisher is not None
        if self.promotion.enabled:
            self.promotion.publisher = cast(CanaryPublisher, self.publisher)
            await self.promotion.stage(checkpoint)
            return
        # A publisher that pauses the engine (in-place reload) would let requests sent meanwhile
        # run on the new weights under the old label: hold new generations at the gate instead.
        pauses = getattr(self.publisher, "pauses_engine", False)
        if pauses:
            self.gate.close("publish")
        try:
            await self.publisher.publish(checkpoint)
        finally:
            if pauses:
                self.gate.open("publish")
        await asyncio.to_thread(self._read, lambda db: promotion.mark_published(
            db, version=checkpoint.version, checkpoint=checkpoint.path, kind=checkpoint.kind,
            promotion="immediate"))

    async def _follow_versions(self, interval_s: float = 1.0) -> None:
        """Serve the newest version a trainer published through another gateway process on this store
        (`serve --workers N`, several gateway hosts): the trainer marks it published in the store."""
        adopt = getattr(self.publisher, "adopt", None)
        if adopt is None:
            return
        while True:
            await asyncio.sleep(interval_s)
            try:
                latest = await self.read(queries.latest_published)
                if latest is None or latest.checkpoint is None or latest.version <= self.engine.version:
                    continue
                async with self._publish_lock:
                    if latest.version > self.engine.version:
                        await adopt(Checkpoint(latest.version, Path(latest.checkpoint), latest.kind))
                        log.info("following version %d, published through another gateway", latest.version)
            except Exception as exc:  # the store or an engine briefly away: try again next round
                log.warning("following the published version failed: %s", exc)

    async def _index_search(self, interval_s: float = 0.5) -> None:
        """Fill SQLite's search index with the calls recorded since the last batch (store/search_index.py)."""
        if not await self.read(search_index.batched):
            return
        seen, indexed = -1, 0
        while True:
            # An idle gateway takes no write lock: its writer has committed nothing since the last batch
            # (another process's calls are indexed by that process), and the last batch was not full.
            if indexed < search_index.BATCH:
                await asyncio.sleep(interval_s)
                if self.writer.committed_ops == seen:
                    continue
            try:
                indexed = await self.writer.submit(search_index.index_new_calls)
            except Exception as exc:  # the store briefly away or full: the search scans the rest meanwhile
                log.warning("indexing calls for the search failed: %s", exc)
                indexed = 0
            seen = self.writer.committed_ops

    def note_served(self, version: int) -> None:
        """A call of `version` was recorded: the first one of a version newer than any this process served
        dates the version's first call (`Policy.first_call_at`; a no-op if another process got there first)."""
        if version <= self._newest_served:
            return
        self._newest_served = version
        at = utcnow()
        task = asyncio.create_task(self.writer.submit(
            lambda db: promotion.record_first_call(db, version=version, at=at)))
        self._notes.add(task)
        task.add_done_callback(self._notes.discard)

    def hold_for_training(self, training: bool) -> None:
        """A `sync`-mode step in this process: close generation while it trains (event loop thread)."""
        (self.gate.close if training else self.gate.open)("train")

    def check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this gateway serves '{self.config.served_model_name}'.",
                code="model_not_found",
                param="model",
            )

    async def session_info(self, session_id: str) -> SessionState | None:
        """Owner and group of a stored session, or None if it does not exist yet."""
        state = self._sessions.get(session_id)
        if state is None:
            state = (self._load_session(session_id) if self._inline_reads
                     else await asyncio.to_thread(self._load_session, session_id))
            if state is None:
                return None
            self._remember(session_id, state)
        self._sessions.move_to_end(session_id)
        return state

    def _load_session(self, session_id: str) -> SessionState | None:
        with self.db.connect() as conn:
            row = queries.session_owner_group(conn, session_id=session_id)
        return None if row is None else SessionState(*row)

    def new_session(self, session_id: str, owner: str | None, group: str, version: int | None) -> SessionState:
        """The state of a session this process is about to create; a concurrent first call finds it."""
        state = self._sessions.get(session_id) or SessionState(owner, group, version)
        self._remember(session_id, state)
        return state

    def _remember(self, session_id: str, state: SessionState) -> None:
        self._sessions[session_id] = state
        while len(self._sessions) > SESSION_CACHE:
            self._sessions.popitem(last=False)

    async def find_parent(self, session_id: str, hashes: list[str], messages: list[dict[str, Any]]) -> ChainNode | None:
        """The latest call whose request + reply the messages start with (longest history first)."""
        for k in range(len(messages) - 1, 0, -1):
            if messages[k - 1]["role"] != "assistant":
                continue
            node = self.chains.get(session_id, hashes[k]) or await asyncio.to_thread(
                self._load_node, session_id, hashes[k], k
            )
            if node is not None:
                return node
        return None

    def _load_node(self, session_id: str, state_hash: str, message_count: int) -> ChainNode | None:
        with Session(self.db) as db:
            call = queries.call_by_state(db, session_id=session_id, state_hash=state_hash)
            if call is None:
                return None
            by_id = {c.id: c for c in queries.session_calls(db, session_id=session_id)}
            node = ChainNode(
                call_id=call.id,
                full_ids=full_ids(call, by_id),
                message_count=message_count,
                has_child=queries.has_chained_child(db, call_id=call.id, session_id=session_id),
                request_messages=full_messages(call, by_id),
            )
        self.chains.put(session_id, state_hash, node)
        return node

    async def latest_node(self, session_id: str) -> ChainNode | None:
        """The session's latest call with its whole chain (text completions extend it by token prefix)."""
        return self.chains.get(session_id, LATEST) or await asyncio.to_thread(self._load_latest, session_id)

    def remember_latest(self, session_id: str, node: ChainNode) -> None:
        self.chains.put(session_id, LATEST, node)

    def _load_latest(self, session_id: str) -> ChainNode | None:
        with Session(self.db) as db:
            call_id = queries.latest_call_id(db, session_id=session_id)
            if call_id is None:
                return None
            by_id = {c.id: c for c in queries.session_calls(db, session_id=session_id)}
            node = ChainNode(call_id, full_ids(by_id[call_id], by_id), 0,
                             has_child=queries.has_chained_child(db, call_id=call_id,
                                                                   session_id=session_id))
        self.chains.put(session_id, LATEST, node)
        return node

    def _read(self, fn: Any) -> Any:
        with Session(self.db) as db:
            return fn(db)

    async def read(self, fn: Any) -> Any:
        """Run a read-only query in a worker thread."""
        return await asyncio.to_thread(self._read, fn)

    def remember_calls(self, session_id: str, calls: list[tuple[str, str]], chains: list[list[int]],
                       message_count: int, request_messages: list[dict[str, Any]]) -> None:
        """Cache the chains of calls just recorded, by (call id, state hash)."""
        for (call_id, state_hash), chain in zip(calls, chains, strict=True):
            self.chains.put(session_id, state_hash,
                            ChainNode(call_id, chain, message_count, request_messages=request_messages))
