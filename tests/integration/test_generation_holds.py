"""Holding generation: a sync-mode trainer in another process holds the gateway's generation over HTTP while
it steps; requests wait (they are not refused) and go on when it lets go or its hold lapses."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import RunningGateway
from tracetrain.config import TrainConfig
from tracetrain.proxy.holds import REMOTE, GenerationHolds, mirror_store_holds
from tracetrain.trainer.service import remote_hold, run_standalone


def _chat_in_background(gw: RunningGateway, results: list[Any]) -> threading.Thread:
    def send() -> None:
        response = httpx.post(f"{gw.v1('held')}/chat/completions", timeout=60,
                              json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        results.append((time.monotonic(), response.status_code))

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def _state(gw: RunningGateway) -> dict[str, Any]:
    return httpx.get(f"{gw.url}/v1/generation", timeout=30).json()  # type: ignore[no-any-return]


def test_remote_trainer_holds_and_releases_generation(gateway: RunningGateway) -> None:
    hold = remote_hold(gateway.url, None, holder="t1", ttl_s=60)
    hold(True)
    assert _state(gateway) == {"open": False, "holders": ["remote:t1"]}
    results: list[Any] = []
    thread = _chat_in_background(gateway, results)
    time.sleep(1.5)
    assert not results  # held, not refused
    released = time.monotonic()
    hold(False)
    thread.join(timeout=60)
    assert results and results[0][1] == 200 and results[0][0] >= released
    assert _state(gateway) == {"open": True, "holders": []}


def test_a_hold_lapses_after_its_ttl(gateway: RunningGateway) -> None:
    """A trainer that dies mid-step must not stall the agents for longer than its hold."""
    remote_hold(gateway.url, None, holder="dead", ttl_s=1.0)(True)
    results: list[Any] = []
    thread = _chat_in_background(gateway, results)
    thread.join(timeout=60)
    assert results and results[0][1] == 200
    assert _state(gateway)["open"] is True


def test_bad_hold_requests_are_400(gateway: RunningGateway) -> None:
    for body in ({"ttl_s": 0}, {"ttl_s": "long"}, {"holder": ""}, {"surprise": 1}):
        response = httpx.post(f"{gateway.url}/v1/generation/hold", json=body, timeout=30)
        assert response.status_code == 400, body
        assert response.json()["error"]["code"]
    assert _state(gateway)["open"] is True


async def test_gate_opens_only_when_every_holder_let_go() -> None:
    """A weight reload that ends inside a sync training step must not reopen generation early."""
    holds = GenerationHolds()
    holds.hold("train")
    holds.hold("publish")
    holds.release("publish")
    assert not holds.is_free() and holds.holders == ["train"]
    waiter = asyncio.create_task(holds.wait())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    holds.release("train")
    await asyncio.wait_for(waiter, 1)
    holds.release("never-held")
    assert holds.is_free()


async def test_a_store_read_older_than_a_local_hold_does_not_undo_it() -> None:
    """A hold placed through this process while the mirror's read of the store was under way is newer than
    that read: the hold stays placed (and a release stays released) until a read that saw it."""
    holds = GenerationHolds()
    reading, answer = asyncio.Event(), asyncio.Event()
    reads: list[list[str]] = [[], [REMOTE_HOLDER], [REMOTE_HOLDER], []]

    async def read_holders() -> list[str]:
        reading.set()
        await answer.wait()
        answer.clear()
        return reads.pop(0)

    mirror = asyncio.create_task(mirror_store_holds(holds, read_holders, interval_s=0.01))
    try:
        await reading.wait()
        holds.hold(REMOTE + REMOTE_HOLDER)  # the route's hold lands while a read that predates it runs
        answer.set()
        await asyncio.sleep(0.05)
        assert holds.holders == [REMOTE + REMOTE_HOLDER]  # the stale empty read did not release it
        answer.set()  # the next read sees the hold
        await asyncio.sleep(0.05)
        holds.release(REMOTE + REMOTE_HOLDER)  # released here while a read that still sees the hold runs
        answer.set()
        await asyncio.sleep(0.05)
        assert holds.is_free()
        answer.set()  # the store agrees
        await asyncio.sleep(0.05)
        assert holds.is_free()
    finally:
        mirror.cancel()


REMOTE_HOLDER = "t9"


def test_standalone_sync_trainer_needs_the_gateway(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gateway-url"):
        run_standalone(TrainConfig(mode="sync"), None, tmp_path, None, None)  # type: ignore[arg-type]
