"""What every route reaches through `GatewayDep`: the parts of one gateway process, and the background
loops started and stopped with it.

The parts are built in one place (tracetrain/compose.py) and handed in whole; each does one job:
- `sessions` (proxy/session_directory.py): who owns a session, the one access check, token chains;
- `publishing` (proxy/publish_control.py): new versions into serving, the canary, replica sync;
- `writer` (store/writer.py): every write to the store, committed in batches;
- `admission`, `holds`, `keys`, `metrics`: admission of new sessions, the generation holds, API keys, metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session

from tracetrain.config import Config
from tracetrain.engines.base import Engine
from tracetrain.proxy.admission import Admission
from tracetrain.proxy.auth import KeyRing
from tracetrain.proxy.engine_sleep import EngineSleep
from tracetrain.proxy.holds import GenerationHolds, mirror_store_holds
from tracetrain.proxy.metrics import GatewayMetrics
from tracetrain.proxy.policy_lines import PolicyLines
from tracetrain.proxy.publish_control import PublishController
from tracetrain.proxy.redact import Redactors
from tracetrain.proxy.render import ChatRenderer
from tracetrain.proxy.session_directory import SessionDirectory
from tracetrain.store import retention, search_index
from tracetrain.store.holds import active_holders
from tracetrain.store.writer import StoreWriter

log = logging.getLogger(__name__)


@dataclass
class Load:
    requests: int = 0
    """HTTP requests in progress, a stream until its last byte (counted by proxy/app.py's `InFlight`): the
    store writer commits on the event loop only while one is in progress."""


class Service(Protocol):
    """A background service started and stopped with the gateway (the trainer thread)."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def stop(self) -> None: ...


class Gateway:
    def __init__(self, config: Config, engine: Engine, renderer: ChatRenderer, db: DBEngine, *,
                 writer: StoreWriter, sessions: SessionDirectory, publishing: PublishController,
                 admission: Admission, holds: GenerationHolds, keys: KeyRing, metrics: GatewayMetrics,
                 redactors: Redactors, load: Load, policies: PolicyLines, retention: retention.Retention | None = None,
                 engine_sleep: EngineSleep | None = None, services: Sequence[Service] = ()) -> None:
        self.config = config
        self.engine = engine
        self.renderer = renderer
        self.db = db
        self.writer = writer
        self.sessions = sessions
        self.publishing = publishing
        self.canaries = publishing.canaries
        """Under `promotion.mode: canary`, each line's new versions serve a share of its new sessions until their
        test decides."""
        self.admission = admission
        """Under `gateway.admission: staleness`, holds new sessions while the trainer has enough work."""
        self.holds = holds
        """Closed while a `sync`-mode training step runs or the engine reloads weights."""
        self.keys = keys
        self.policies = policies
        """The named policies, and which one a call's `model` names (proxy/policy_lines.py)."""
        self.redactors = redactors
        """What is kept of each call (`gateway.redaction`, `gateway.redaction_patterns`, a key's own
        `redaction`; proxy/redact.py)."""
        self.retention = retention
        """How long sessions keep their content (the gateway's, a key's, a policy's); None: no purges."""
        self.metrics = metrics
        self.engine_sleep = engine_sleep
        """vLLM asleep during `sync`-mode steps on a GPU it shares with the trainer (proxy/engine_sleep.py)."""
        self.services = list(services)
        self.load = load
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.policies.start()
        await self.writer.start()
        if hasattr(self.engine, "start"):  # a replica set's health checks
            self.engine.start()
        await self.publishing.start()
        self._tasks.append(asyncio.create_task(mirror_store_holds(self.holds, lambda: self.read(active_holders))))
        self._tasks.append(asyncio.create_task(self._index_search()))
        if self.retention is not None:
            self._tasks.append(asyncio.create_task(self._purge_expired(self.retention)))
        if self.engine_sleep is not None:
            self._tasks.append(asyncio.create_task(self.engine_sleep.run()))
        for service in self.services:
            service.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.publishing.stop()
        for service in reversed(self.services):
            await asyncio.to_thread(service.stop)
        await self.writer.stop()
        await self.engine.close()

    async def read(self, fn: Any) -> Any:
        """Run a read-only query in a worker thread."""
        return await read_in_thread(self.db, fn)

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

    async def _purge_expired(self, rules: retention.Retention) -> None:
        """Purge as the gateway starts, then every `store.retention_interval_s`; each batch of sessions is one
        writer transaction, so calls keep being recorded in between."""
        while True:
            try:
                purged = await retention.purge(self.writer.submit, self.db, retention=rules, actor="retention")
                if purged:
                    log.info("retention: cleared the content of %d sessions", purged)
            except Exception as exc:  # the store briefly away: the next round goes on where this one stopped
                log.warning("purging expired sessions failed: %s", exc)
            await asyncio.sleep(self.config.store.retention_interval_s)


async def read_in_thread(db: DBEngine, fn: Callable[[Session], Any]) -> Any:
    """Run a read-only query on its own session in a worker thread, off the event loop."""
    def run() -> Any:
        with Session(db) as session:
            return fn(session)

    return await asyncio.to_thread(run)


async def get_gateway(request: Request) -> Gateway:
    # `async` although it never awaits: FastAPI runs a plain `def` dependency in a worker thread.
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
"""A route's gateway: `gw: GatewayDep`."""
