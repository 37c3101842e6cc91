"""The agreement on full-weight reloads between gateway processes (proxy/replica_sync.py), on a real
store (SQLite file and PostgreSQL): a reload waits until the other processes' calls on the replica have
finished, they route nothing there meanwhile and label it with the new version before routing to it
again, a process started later takes the label from the store, and a reload whose process died is
repaired by another.

Each `ReplicaSync` stands for one gateway process: its own replica set and its own store writer, over
the same URLs. No vLLM is involved here: the calls are counted by the replica set's own bookkeeping
(what `generate` does around a request), and the repair's reload is recorded rather than sent
(tests/integration/test_gateway_workers.py reloads a real vLLM under two real worker processes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from sqlmodel import Session

from tracetrain.engines.base import SamplingParams, TokenDelta
from tracetrain.engines.publishing import Checkpoint
from tracetrain.engines.replicas import Replica, ReplicaSet
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.proxy.replica_sync import ReplicaSync
from tracetrain.store.db import open_db
from tracetrain.store.writer import StoreWriter

URL = "http://127.0.0.1:9"  # never contacted


class Process:
    """One gateway process's view: a replica set over URL, a store writer, and its ReplicaSync."""

    def __init__(self, db: Any, restored: list[Checkpoint] | None = None, lease_s: float = 30.0) -> None:
        self.replicas = ReplicaSet([Replica(VLLMEngine(URL, "m"))])
        self.writer = StoreWriter(db)
        self.db = db
        self.restored = restored

        async def restore(index: int, checkpoint: Checkpoint) -> None:
            assert restored is not None
            holds = await self.sync.begin_reload(URL, checkpoint.version)
            assert holds is None
            restored.append(checkpoint)
            await self.sync.end_reload(URL, checkpoint.version, checkpoint.path, None)
            self.replicas.replicas[index].engine.use_adapter(None, checkpoint.version)
            self.replicas.replicas[index].publishing = False
            self.replicas.bring_back(index)

        self.sync = ReplicaSync(self.replicas, read=self.read, write=self.writer.submit, base_weights=Path("/base"),
                                restore=restore if restored is not None else None, interval_s=0.05,
                                heartbeat_s=0.1, liveness_s=2.0, lease_s=lease_s, drain_timeout_s=20)
        self.task: asyncio.Task[None] | None = None

    async def read(self, fn: Callable[[Session], Any]) -> Any:
        def run() -> Any:
            with Session(self.db) as db:
                return fn(db)
        return await asyncio.to_thread(run)

    async def start(self) -> Process:
        await self.writer.start()
        await self.sync.start()
        self.task = asyncio.create_task(self.sync.run())
        return self

    async def stop(self, *, crash: bool = False) -> None:
        if self.task is not None:
            self.task.cancel()
        if crash:  # no goodbye: its heartbeat and any claim it holds lapse
            for task in self.sync._renewals.values():
                task.cancel()
        else:
            await self.sync.stop()
        await self.writer.stop()

    @property
    def label(self) -> int:
        return self.replicas.replicas[0].engine.version

    @property
    def routable(self) -> bool:
        return self.replicas.router.up[0]


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Any]:
    yield open_db(db_url)


async def test_a_reload_waits_for_the_other_process_which_then_labels_before_routing(store: Any) -> None:
    a, b = await Process(store).start(), await Process(store).start()
    try:
        b.replicas.router.started(0)  # a call of b's is running on the replica
        begin = asyncio.create_task(a.sync.begin_reload(URL, 1))
        await until(lambda: not b.routable)  # b stopped routing there within its poll interval
        await asyncio.sleep(0.5)
        assert not begin.done(), "the reload began while b still had a call on the replica"
        b.replicas.router.finished(0)
        assert await asyncio.wait_for(begin, 5) is None  # b acknowledged: a may reload
        assert (b.label, b.routable) == (0, False)
        await a.sync.end_reload(URL, 1, Path("/ckpt/v1"), None)
        await until(lambda: b.routable)
        assert b.label == 1  # labelled before it was routable again: checked in the same poll
        late = await Process(store).start()  # a process started after the reload
        try:
            assert late.label == 1 and late.routable
        finally:
            await late.stop()
    finally:
        await a.stop()
        await b.stop()


async def test_a_failed_reload_keeps_the_version_and_the_replica_out(store: Any) -> None:
    a, b = await Process(store).start(), await Process(store).start()
    try:
        assert await a.sync.begin_reload(URL, 1) is None
        await a.sync.end_reload(URL, None, None, "PublishError: vLLM refused")
        await until(lambda: not b.replicas.replicas[0].publishing)
        assert b.label == 0 and not b.routable
        assert "vLLM refused" in (b.replicas.replicas[0].reason or "")
        assert [e.event for e in b.replicas.events][-1] == "publish_failed"
    finally:
        await a.stop()
        await b.stop()


async def test_a_process_that_never_acknowledges_fails_the_reload_not_the_replica(store: Any) -> None:
    a, b = await Process(store).start(), await Process(store).start()
    a.sync.drain_timeout_s = 1.0
    try:
        b.replicas.router.started(0)  # never finishes
        with pytest.raises(Exception, match="did not stop sending"):
            await a.sync.begin_reload(URL, 1)
        b.replicas.router.finished(0)
        await until(lambda: not b.replicas.replicas[0].publishing)
        assert b.label == 0
    finally:
        await a.stop()
        await b.stop()


async def test_a_reload_whose_process_died_is_repaired_by_another(store: Any) -> None:
    restored: list[Checkpoint] = []
    a = await Process(store, lease_s=1.0).start()
    b = await Process(store, restored=restored).start()
    try:
        assert await a.sync.begin_reload(URL, 1) is None
        await until(lambda: not b.routable)
        await a.stop(crash=True)  # mid-reload: the replica's weights are unknown
        await until(lambda: bool(restored), timeout=15)
        assert restored == [Checkpoint(0, Path("/base"), "full")]  # the last weights recorded for it
        await until(lambda: b.routable)
        assert b.label == 0
    finally:
        await b.stop()


async def test_a_process_taken_for_dead_follows_the_store_before_it_routes_again(store: Any) -> None:
    """b's loop stalls past the liveness window (its follower stops), a reloads without waiting for it;
    b's next call is sent under the version the store now records, not the label b had."""
    a, b = await Process(store).start(), await Process(store).start()
    sent_under: list[int] = []
    engine = b.replicas.replicas[0].engine

    async def record(prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        sent_under.append(engine.version)
        yield TokenDelta(token_ids=[1], logprobs=[-0.1], text="x", finish_reason="stop")

    async def healthy() -> bool:
        return True

    # The engine stands for vLLM: it answers health checks and records which label each call went with.
    engine.generate = record  # type: ignore[method-assign]
    engine.health = healthy  # type: ignore[method-assign]
    try:
        assert b.task is not None
        b.task.cancel()  # b's loop stalls: no heartbeat, no poll
        await asyncio.sleep(b.sync.liveness_s + 0.5)
        assert await asyncio.wait_for(a.sync.begin_reload(URL, 1), 5) is None  # b is not waited for
        await a.sync.end_reload(URL, 1, Path("/ckpt/v1"), None)
        assert b.label == 0  # b has not seen the reload
        async for _ in b.replicas.generate([1, 2, 3], SamplingParams(max_tokens=1)):
            pass
        assert sent_under == [1]
    finally:
        await a.stop()
        await b.stop()


async def test_a_health_check_in_flight_does_not_bring_back_a_replica_drained_meanwhile() -> None:
    """A replica's periodic health check awaits the server's answer; another process's reload drains the
    replica meanwhile. The healthy answer, read against the now drained replica, must not put it back in
    routing mid-reload, where this process's calls would go out labelled with the old version (seen once
    as a mislabelled call in test_gateway_workers.py's reload under two worker processes)."""
    asked, release = asyncio.Event(), asyncio.Event()

    async def health(_: web.Request) -> web.Response:
        asked.set()
        await release.wait()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    replicas = ReplicaSet([Replica(VLLMEngine(f"http://127.0.0.1:{port}", "m"))])
    try:
        check = asyncio.create_task(replicas._check(0))
        await asyncio.wait_for(asked.wait(), timeout=10)
        replicas.drain(0, "version 1 loading through gateway process b")
        release.set()
        await asyncio.wait_for(check, timeout=10)
        assert not replicas.router.up[0], "a replica being reloaded was put back in routing"
        replicas.replicas[0].publishing = False  # the reload is over: the next check may bring it back
        await replicas._check(0)
        assert replicas.router.up[0]
    finally:
        await replicas.close()
        await runner.cleanup()
