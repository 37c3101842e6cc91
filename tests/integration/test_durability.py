"""SIGKILL the gateway under concurrent load, plain and streamed: every answered call and reward is in
the store, on SQLite and on a PostgreSQL cluster with production durability settings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, select

from tests.support.servers import PostgresCluster, free_port
from tracetrain.store.db import open_db
from tracetrain.store.models import Call, Reward

pytestmark = pytest.mark.slow

WORKERS = 16
STREAMING_WORKERS = frozenset(range(0, WORKERS, 2))
"""Half the workers stream, so the kill lands both inside plain requests and inside open streams."""
KILL_AFTER = 60
"""Answered calls before the kill: enough that commits are in flight when it lands."""
MIN_STREAMED = 20
"""Of those, streams that reached their final chunk, so the streamed path is really exercised."""


@dataclass
class Answered:
    """What the clients saw succeed: the gateway promised these are in the store."""

    plain: list[str] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)
    rewarded: list[str] = field(default_factory=list)

    def calls(self) -> int:
        return len(self.plain) + len(self.streamed)


@pytest.fixture(params=["sqlite", "postgres"])
def durable_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store with the durability a deployment has: SQLite with the gateway's default
    synchronous=FULL, or a database in the fsync=on cluster (not the shared fsync=off one)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    cluster: PostgresCluster = request.getfixturevalue("durable_postgres")
    return cluster.create_database(f"t_{uuid.uuid4().hex[:12]}")


def _start_gateway(model_dir: Path, db_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    process = _spawn_gateway(model_dir, db_url, port, log)
    _wait_for_gateway(process, port, log)
    return process


def _spawn_gateway(model_dir: Path, db_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`tracetrain serve` on the tiny model, not waited for: several can start side by side."""
    command = [sys.executable, "-m", "tracetrain.cli", "serve", "--engine", "transformers", "--model",
               str(model_dir), "--served-model-name", "tiny", "--db-url", db_url, "--port", str(port)]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _wait_for_gateway(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("gateway did not become healthy")


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], answered: list[str]) -> bool:
    """Read one SSE stream to its end. The completion id goes into `answered` as soon as the final
    chunk (a choice with a finish_reason) arrives: the gateway commits the call before sending it,
    so from then on the call must survive even if the connection dies before `data: [DONE]`."""
    finished = False
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return finished
            chunk = json.loads(data)
            if "error" in chunk:  # the engine failed mid-stream: nothing was promised
                return False
            if not finished and any(c.get("finish_reason") for c in chunk["choices"]):
                answered.append(chunk["id"])
                finished = True
    return finished


async def _load(base: str, answered: Answered, stop: asyncio.Event) -> None:
    async def worker(w: int) -> None:
        streaming = w in STREAMING_WORKERS
        async with httpx.AsyncClient(timeout=30) as client:
            turn = 0
            while not stop.is_set():
                session = f"kill-{w}-{turn}"
                url = f"{base}/s/{session}/v1/chat/completions"
                body = {"model": "tiny", "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"worker {w} turn {turn}"}]}
                try:
                    if streaming:
                        ok = await _stream(client, url, body, answered.streamed)
                    else:
                        response = await client.post(url, json=body)
                        ok = response.status_code == 200
                        if ok:
                            answered.plain.append(response.json()["id"])
                    if ok:
                        reward = await client.post(f"{base}/v1/rewards", json={"session_id": session, "reward": 1.0})
                        if reward.status_code == 200:
                            answered.rewarded.append(session)
                except httpx.TransportError:  # the kill: connection refused, reset or cut mid-stream
                    return
                turn += 1

    await asyncio.gather(*(worker(w) for w in range(WORKERS)))


async def test_sigkill_under_load_loses_no_answered_call(tiny_model_path: Path, durable_db_url: str,
                                                         tmp_path: Path) -> None:
    db_url = durable_db_url
    if db_url.startswith("postgresql"):
        # The point of this variant: commits the server acknowledged are flushed to disk.
        probe = create_engine(db_url)  # not open_db: leave creating the tables to the gateway
        with probe.connect() as conn:
            settings = {name: conn.exec_driver_sql(f"SHOW {name}").scalar()
                        for name in ("fsync", "synchronous_commit", "full_page_writes")}
        probe.dispose()
        assert settings == {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}

    port = free_port()
    log = tmp_path / "gateway.log"
    process = _start_gateway(tiny_model_path, db_url, port, log)
    answered = Answered()
    stop = asyncio.Event()
    load = asyncio.create_task(_load(f"http://127.0.0.1:{port}", answered, stop))
    try:
        deadline = time.monotonic() + 120
        while ((answered.calls() < KILL_AFTER or len(answered.streamed) < MIN_STREAMED)
               and time.monotonic() < deadline and not load.done()):
            await asyncio.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        stop.set()
        if process.poll() is None:
            process.kill()
    await asyncio.wait_for(load, 60)

    assert answered.calls() >= KILL_AFTER, log.read_text()[-2000:]
    assert len(answered.streamed) >= MIN_STREAMED, log.read_text()[-2000:]
    with Session(open_db(db_url)) as db:
        stored = set(db.exec(select(Call.completion_id)).all())
        stored_rewards = set(db.exec(select(Reward.session_id)).all())
    missing_plain = set(answered.plain) - stored
    missing_streamed = set(answered.streamed) - stored
    assert not missing_plain, f"{len(missing_plain)} of {len(answered.plain)} answered plain calls missing"
    assert not missing_streamed, f"{len(missing_streamed)} of {len(answered.streamed)} finished streams missing"
    assert set(answered.rewarded) <= stored_rewards
