"""vLLM sleeps while a sync-mode step trains, and wakes for the publish (proxy/engine_sleep.py).

vLLM's sleep mode exists on CUDA only, so vLLM on this CPU cannot serve `/sleep` and `/wake_up`. The
replica here is a small real HTTP server with those endpoints (and nothing else), standing in for a GPU
vLLM: it records the calls in order. The real endpoints are exercised by tests/gpu/ on a GPU machine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from fastapi import FastAPI

from tests.support.servers import free_port
from tracetrain.engines.replicas import Replica, ReplicaSet
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.proxy.engine_sleep import ASLEEP, EngineSleep
from tracetrain.proxy.holds import GenerationHolds

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the loop of the `sleeping` fixture's task


@pytest.fixture
def sleep_endpoints() -> Iterator[tuple[str, list[str]]]:
    calls: list[str] = []
    app = FastAPI()

    @app.post("/sleep")
    async def sleep(level: int) -> dict[str, bool]:
        calls.append(f"sleep {level}")
        return {"ok": True}

    @app.post("/wake_up")
    async def wake_up(tags: str) -> dict[str, bool]:
        calls.append(f"wake {tags}")
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.05)
    yield f"http://127.0.0.1:{port}", calls
    server.should_exit = True
    thread.join(timeout=10)


@dataclass
class Sleeping:
    """One replica (the stand-in server), the generation holds and the sleep loop running over them."""

    sleeper: EngineSleep
    holds: GenerationHolds
    replicas: ReplicaSet
    calls: list[str]
    """What the replica was asked, in order."""


@pytest.fixture
async def sleeping(sleep_endpoints: tuple[str, list[str]]) -> AsyncIterator[Sleeping]:
    url, calls = sleep_endpoints
    replicas = ReplicaSet([Replica(VLLMEngine(url, model_name="m"))])
    holds = GenerationHolds()
    sleeper = EngineSleep(holds, replicas, interval_s=0.01)
    task = asyncio.create_task(sleeper.run())
    yield Sleeping(sleeper, holds, replicas, calls)
    task.cancel()
    await replicas.close()


async def _until(condition: object, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_sleeps_once_drained_and_keeps_calls_out_until_awake(sleeping: Sleeping) -> None:
    sleeper, holds, replicas, calls = sleeping.sleeper, sleeping.holds, sleeping.replicas, sleeping.calls
    replicas.router.outstanding[0] = 1  # a call still running: the engine must not sleep under it
    holds.hold("train")
    await asyncio.sleep(0.1)
    assert calls == [] and not sleeper.asleep
    replicas.router.outstanding[0] = 0
    await _until(lambda: calls)
    assert calls == ["sleep 1"] and ASLEEP in holds.holders and sleeper.asleep
    await sleeper.wake()  # what a publish does first
    assert calls == ["sleep 1", "wake weights", "wake kv_cache"]  # weights before the cache
    assert holds.holders == ["train"]  # still held by the step until it ends
    holds.release("train")
    await asyncio.sleep(0.1)
    assert holds.is_free() and sleeper.cycles == 1 and len(calls) == 3  # awake already: no second wake


async def test_a_hold_that_ends_wakes_the_engine(sleeping: Sleeping) -> None:
    sleeper, holds, calls = sleeping.sleeper, sleeping.holds, sleeping.calls
    holds.hold("remote:trainer-7")  # a trainer in another process, mirrored from the store
    await _until(lambda: calls)
    holds.release("remote:trainer-7")
    await _until(lambda: holds.is_free())
    assert calls == ["sleep 1", "wake weights", "wake kv_cache"] and not sleeper.asleep
    holds.hold("publish")  # a publish's own pause is not a training step
    await asyncio.sleep(0.1)
    assert not sleeper.asleep


async def test_a_publish_keeps_the_engine_awake_until_it_is_done(sleeping: Sleeping) -> None:
    """The training hold outlasts the publish (sync mode releases it once the publish returns), and the
    publish's probe scores the new version on the engine: the engine must not fall asleep under it. On a
    GPU it did, 0.2 s after waking: the probe waited on a sleeping engine until it timed out."""
    sleeper, holds, calls = sleeping.sleeper, sleeping.holds, sleeping.calls
    holds.hold("train")
    await _until(lambda: sleeper.asleep)
    async with sleeper.awake():  # what a publish does around loading and probing
        assert not sleeper.asleep and calls == ["sleep 1", "wake weights", "wake kv_cache"]
        await asyncio.sleep(0.2)  # twenty rounds of the sleep loop, with the step's hold still on
        assert not sleeper.asleep and len(calls) == 3
    await _until(lambda: sleeper.asleep)  # the step still holds: back to sleep once the publish is done
    holds.release("train")
    await _until(lambda: not sleeper.asleep)
    assert calls == ["sleep 1", "wake weights", "wake kv_cache", "sleep 1", "wake weights", "wake kv_cache"]
