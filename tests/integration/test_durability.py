"""SIGKILL the gateway under concurrent load: every answered call and reward is in the store."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlmodel import Session, select

from tests.support.servers import free_port
from tracetrain.store.db import make_engine
from tracetrain.store.models import Call, Reward

WORKERS = 16
KILL_AFTER = 60
"""Answered calls before the kill: enough that commits are in flight when it lands."""


def _start_gateway(model_dir: Path, db_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tracetrain.cli", "serve", "--engine", "transformers", "--model",
               str(model_dir), "--served-model-name", "tiny", "--db-url", db_url, "--port", str(port)]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("gateway did not become healthy")


async def _load(base: str, answered: list[str], rewarded: list[str], stop: asyncio.Event) -> None:
    async def worker(w: int) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            turn = 0
            while not stop.is_set():
                session = f"kill-{w}-{turn}"
                try:
                    response = await client.post(f"{base}/s/{session}/v1/chat/completions", json={
                        "model": "tiny", "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"worker {w} turn {turn}"}]})
                    if response.status_code == 200:
                        answered.append(response.json()["id"])
                        reward = await client.post(f"{base}/v1/rewards",
                                                   json={"session_id": session, "reward": 1.0})
                        if reward.status_code == 200:
                            rewarded.append(session)
                except httpx.TransportError:
                    return
                turn += 1

    await asyncio.gather(*(worker(w) for w in range(WORKERS)))


async def test_sigkill_under_load_loses_no_answered_call(tiny_model_path: Path, db_url: str,
                                                         tmp_path: Path) -> None:
    port = free_port()
    process = _start_gateway(tiny_model_path, db_url, port, tmp_path / "gateway.log")
    answered: list[str] = []
    rewarded: list[str] = []
    stop = asyncio.Event()
    load = asyncio.create_task(_load(f"http://127.0.0.1:{port}", answered, rewarded, stop))
    try:
        deadline = time.monotonic() + 120
        while len(answered) < KILL_AFTER and time.monotonic() < deadline and not load.done():
            await asyncio.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        stop.set()
        if process.poll() is None:
            process.kill()
    await asyncio.wait_for(load, 60)

    assert len(answered) >= KILL_AFTER, (tmp_path / "gateway.log").read_text()[-2000:]
    with Session(make_engine(db_url)) as db:
        stored = set(db.exec(select(Call.completion_id)).all())
        stored_rewards = set(db.exec(select(Reward.session_id)).all())
    assert set(answered) <= stored, f"{len(set(answered) - stored)} answered calls missing"
    assert set(rewarded) <= stored_rewards
