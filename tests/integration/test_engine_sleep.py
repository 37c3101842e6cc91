"""vLLM sleeps while a sync-mode step trains, and wakes for the publish (proxy/engine_sleep.py).

vLLM's sleep mode exists on CUDA only, so vLLM on this CPU cannot serve `/sleep` and `/wake_up`. The
replica here is a small real HTTP server with those endpoints, and the two a LoRA load needs (`/v1/models`,
`/v1/load_lora_adapter`), standing in for a GPU vLLM: it records the calls in order. The real endpoints
are exercised by tests/gpu/ on a GPU machine.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI
from safetensors.torch import save_file
from sqlmodel import Session

from tests.support.servers import free_port
from tracetrain.config import PromotionConfig
from tracetrain.engines.replica_publish import ReplicaPublisher
from tracetrain.engines.replicas import Replica, ReplicaSet
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_publish import VLLMLoRAPublisher
from tracetrain.proxy.engine_sleep import ASLEEP, EngineSleep
from tracetrain.proxy.gateway import read_in_thread
from tracetrain.proxy.holds import GenerationHolds
from tracetrain.proxy.promotion import Canaries
from tracetrain.proxy.publish_control import PublishController
from tracetrain.store import promotion
from tracetrain.store.db import open_db
from tracetrain.store.models import Policy
from tracetrain.store.writer import StoreWriter

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

    loaded: list[str] = []

    @app.get("/v1/models")
    async def models() -> dict[str, list[dict[str, str]]]:
        return {"data": [{"id": name} for name in ["m", *loaded]]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: dict[str, Any]) -> dict[str, bool]:
        calls.append(f"load {body['lora_name']}")
        loaded.append(body["lora_name"])
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


async def test_a_version_followed_from_the_store_is_loaded_awake(sleeping: Sleeping, tmp_path: Path) -> None:
    """A gateway that follows a version published through another process, or that restarted and catches up
    to the version its store says is served, loads it the way a publish does: with the engine awake, even
    while a step holds generation (and the engine would otherwise sleep under the load)."""
    sleeper, holds, replicas, calls = sleeping.sleeper, sleeping.holds, sleeping.replicas, sleeping.calls
    adapter = tmp_path / "v1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 1}')
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(1, 2)}, str(adapter / "adapter_model.safetensors"))
    db = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    with Session(db) as s:  # a trainer wrote version 1 and another gateway process published it
        s.add(Policy(version=1, checkpoint=str(adapter), kind="lora"))
        s.commit()
        promotion.mark_published(s, version=1, checkpoint=adapter, kind="lora", promotion="immediate")
    writer = StoreWriter(db)
    await writer.start()
    read = functools.partial(read_in_thread, db)
    engine = replicas.replicas[0].engine
    publisher = ReplicaPublisher(replicas, [VLLMLoRAPublisher(engine)])
    controller = PublishController(replicas, publisher, writer=writer, read=read, holds=holds,
                                   canaries=Canaries(PromotionConfig(), replicas, read=read, write=writer.submit,
                                                     publisher=None),
                                   engine_sleep=sleeper)
    holds.hold("train")
    await _until(lambda: sleeper.asleep)
    await controller.start()
    try:
        await _until(lambda: replicas.version == 1)
        assert calls[:4] == ["sleep 1", "wake weights", "wake kv_cache", "load policy-v1"]
        await _until(lambda: len(calls) == 5)  # the step still holds: back to sleep once the load is done
        assert calls[4] == "sleep 1"
    finally:
        await controller.stop()
        holds.release("train")
        await writer.stop()
    await _until(lambda: len(calls) == 7)  # awake when the test ends, as the others leave it
