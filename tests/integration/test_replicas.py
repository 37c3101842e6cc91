"""Two real vLLM CPU replicas behind one gateway: sticky routing, version-consistent publishing, a
replica SIGKILLed under load, and backpressure.

Replica 0 is the session's shared vLLM server (LoRA rank up to 16); replica 1 is started here, by the
replica set's own `VLLMServer`, with LoRA rank up to 8, so a rank-16 adapter really fails to load on it
(vLLM refuses it), and the test can kill it and watch the set start it again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from tests.integration.conftest import RunningVLLM
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.replica_publish import ReplicaPublisher
from tracetrain.engines.replicas import Replica, ReplicaSet
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_publish import VLLMLoRAPublisher
from tracetrain.engines.vllm_server import VLLMServer, replica_placement
from tracetrain.store.models import Call

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def second_server(vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    server = VLLMServer(vllm_server.model_dir, served_model_name=vllm_server.model_name,
                        max_model_len=vllm_server.max_model_len, kv_cache_gib=1, enable_lora=True,
                        max_lora_rank=8, log_path=tmp_path_factory.mktemp("vllm-2") / "vllm.log",
                        env=replica_placement(1, 2))  # its own cores, not the first server's
    with server:
        yield server


@pytest.fixture(scope="module")
def adapters(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.integration.test_publish import load_model, save_lora

    base = load_model(smollm2_path)
    root = tmp_path_factory.mktemp("replica-lora")
    return {"rank16": save_lora(base, root / "r16", seed=1, rank=16), "rank8": save_lora(base, root / "r8", seed=2)}


@pytest.fixture(scope="module")
def replicated(vllm_server: RunningVLLM, second_server: VLLMServer, smollm2_path: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """A gateway over both replicas, publishing LoRA adapters to both (module-scoped: the tests below
    run in order, each building on the state the previous one left)."""
    replicas = ReplicaSet([Replica(VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120)),
                           Replica(VLLMEngine(second_server.url, vllm_server.model_name, timeout=120),
                                   server=second_server)],
                          spill_at=4, max_outstanding=4, queue_wait_s=2.0, queue_limit=4, health_interval_s=0.5)
    publisher = ReplicaPublisher(replicas, [VLLMLoRAPublisher(r.engine, prefix=f"replica{i}")
                                            for i, r in enumerate(replicas.replicas)])

    db = tmp_path_factory.mktemp("replicas") / "store.db"
    running = start_gateway(replicas, smollm2_path, f"sqlite:///{db}", publisher=publisher)
    yield running
    running.stop()


def chat(gw: RunningGateway, session: str, messages: list[dict[str, Any]], max_tokens: int = 8,
         timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{gw.v1(session)}/chat/completions", timeout=timeout,
                      json={"model": gw.gateway.config.engine.served_model_name, "messages": messages,
                            "max_tokens": max_tokens, "temperature": 1.0})


def streamed(gw: RunningGateway, session: str, messages: list[dict[str, Any]]) -> tuple[str, int]:
    """(completion id, 200) for a stream that ended with [DONE], ("", status) for one that ended
    with an error event or status; a stream cut without either raises."""
    body = {"model": gw.gateway.config.engine.served_model_name, "messages": messages, "max_tokens": 24, "stream": True}
    with httpx.stream("POST", f"{gw.v1(session)}/chat/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            return "", response.status_code
        completion_id = ""
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return completion_id, 200
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return "", 502
            completion_id = chunk["id"]
    raise httpx.RemoteProtocolError("stream ended without [DONE] or an error event")


def stored_calls(gw: RunningGateway) -> list[Call]:
    with Session(gw.gateway.db) as db:
        return list(db.exec(select(Call)).all())


def replica_set(gw: RunningGateway) -> ReplicaSet:
    engine = gw.gateway.engine
    assert isinstance(engine, ReplicaSet)
    return engine


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def test_sessions_stick_to_their_replica_and_new_ones_spread(replicated: RunningGateway) -> None:
    for turn in range(3):
        for s in range(4):
            history = [{"role": "user", "content": f"Count to {s + 3}, turn {turn}."}]
            assert chat(replicated, f"stick-{s}", history).status_code == 200
    by_session: dict[str, set[str]] = {}
    for call in stored_calls(replicated):
        by_session.setdefault(call.session_id, set()).add(call.request_params["replica"])
    assert all(len(replicas) == 1 for replicas in by_session.values()), by_session
    assert len(set().union(*by_session.values())) == 2  # four new sessions used both replicas
    routes = [c.request_params["route"] for c in stored_calls(replicated)]
    assert routes.count("sticky") == 8 and routes.count("least_loaded") == 4


def test_a_version_reaches_every_replica_that_can_load_it(replicated: RunningGateway, adapters: dict[str, Path],
                                                          vllm_server: RunningVLLM) -> None:
    replicas = replica_set(replicated)
    admin = {"Authorization": "Bearer unused"}
    # Rank 16 loads on replica 0 and is refused by replica 1 (max rank 8): 1 is taken out, 0 serves v1.
    response = httpx.post(f"{replicated.url}/v1/policies", headers=admin, timeout=120,
                          json={"version": 1, "checkpoint": str(adapters["rank16"]), "kind": "lora"})
    assert response.status_code == 200, response.text
    state = httpx.get(f"{replicated.url}/v1/replicas", headers=admin).json()
    by_url = {r["replica"]: r for r in state["data"]}
    assert by_url[vllm_server.url] == {**by_url[vllm_server.url], "up": True, "version": 1}
    broken = next(r for url, r in by_url.items() if url != vllm_server.url)
    assert not broken["up"] and broken["version"] == 0 and "rank" in broken["reason"].lower()
    assert any(e["event"] == "publish_failed" for e in state["events"])
    for s in range(4):  # every session now runs on replica 0, as version 1
        assert chat(replicated, f"v1-{s}", [{"role": "user", "content": "Hi"}]).headers["x-policy-version"] == "1"
    # A rank-8 version 2 loads on replica 0; replica 1 catches up to it and rejoins.
    response = httpx.post(f"{replicated.url}/v1/policies", headers=admin, timeout=120,
                          json={"version": 2, "checkpoint": str(adapters["rank8"]), "kind": "lora"})
    assert response.status_code == 200, response.text
    wait_until(lambda: all(replicas.router.up), 60, "replica 1 to catch up to version 2")
    assert [r.engine.version for r in replicas.replicas] == [2, 2]
    for s in range(4):
        assert chat(replicated, f"v2-{s}", [{"role": "user", "content": "Hi"}]).status_code == 200
    # No call ever recorded a version its replica did not serve: replica 1 never served version 1.
    served = {(c.request_params["replica"], c.policy_version) for c in stored_calls(replicated)}
    assert (broken["replica"], 1) not in served
    assert {v for _, v in served} == {0, 1, 2}


def test_a_replica_killed_under_load_loses_nothing_and_comes_back(replicated: RunningGateway,
                                                                   second_server: VLLMServer,
                                                                   adapters: dict[str, Path]) -> None:
    replicas = replica_set(replicated)
    # A named policy's version in both replicas: the killed one must come back serving it too.
    assert httpx.post(f"{replicated.url}/v1/policies", json={"name": "support"}).status_code == 200
    response = httpx.post(f"{replicated.url}/v1/policies", timeout=120, json={
        "version": 1, "checkpoint": str(adapters["rank8"]), "kind": "lora", "policy": "support"})
    assert response.status_code == 200, response.text
    assert [r.engine.line_versions() for r in replicas.replicas] == [{"support": 1}] * 2
    results: list[tuple[str, int]] = []
    stop = threading.Event()

    def agent(n: int) -> None:
        turn = 0
        while not stop.is_set():
            session = f"load-{n}-{turn}"
            messages = [{"role": "user", "content": f"Tell me about {turn}."}]
            try:
                if n % 2:
                    response = chat(replicated, session, messages, max_tokens=24)
                    results.append((response.json().get("id", ""), response.status_code))
                else:
                    results.append(streamed(replicated, session, messages))
            except httpx.HTTPError:
                results.append(("", -1))
            turn += 1

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: sum(status == 200 for _, status in results) >= 8, 120, "8 calls answered before the kill")
    assert second_server.process is not None
    os.killpg(second_server.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    time.sleep(15)
    after_kill = len(results)
    time.sleep(10)
    stop.set()
    for t in threads:
        t.join(timeout=180)
    statuses = [status for _, status in results]
    assert -1 not in statuses  # every call was answered
    assert all(status == 200 or status >= 500 for status in statuses), statuses
    assert len(results) > after_kill and statuses[-1] == 200  # the other replica kept serving
    answered = {call_id for call_id, status in results if status == 200}
    stored = {c.completion_id for c in stored_calls(replicated)}
    assert answered <= stored  # every answered call is in the store
    # The set starts the dead server again, brings it to version 2 and routes to it.
    wait_until(lambda: all(replicas.router.up), 400, "the killed replica to serve again")
    back_after = time.monotonic() - killed_at
    assert [r.engine.version for r in replicas.replicas] == [2, 2]
    assert [r.engine.line_versions() for r in replicas.replicas] == [{"support": 1}] * 2
    events = [e.event for e in replicas.events if e.replica == second_server.url]
    assert "restarting" in events and events[-1] == "up"
    print(f"failed {statuses.count(502) + statuses.count(503)} of {len(statuses)} calls; "
          f"killed replica serving again after {back_after:.0f} s")


def test_beyond_the_bound_requests_wait_then_get_429(replicated: RunningGateway) -> None:
    # max_outstanding 4 per replica, at most 4 waiting for 2 s: 20 long requests at once overflow.
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(
                f"{replicated.v1(f'burst-{i}')}/chat/completions",
                json={"model": replicated.gateway.config.engine.served_model_name, "max_tokens": 64,
                      "messages": [{"role": "user", "content": "Write a long story."}]}) for i in range(20)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= 8 and 429 in statuses, statuses
    busy = next(r for r in responses if r.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1
    assert busy.json()["error"]["code"] == "engine_busy" and busy.json()["error"]["type"] == "rate_limit_error"
    stored = {c.session_id for c in stored_calls(replicated)}
    assert {f"burst-{i}" for i, s in enumerate(statuses) if s == 200} <= stored


def _reload_base(url: str, model_dir: Path) -> None:
    """Put a server's original weights back (the servers are shared with later test modules)."""
    from tracetrain.engines.vllm_server import http_client

    with http_client(url, timeout=300) as client:
        client.post("/pause", params={"mode": "wait"})
        try:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
            assert client.post("/collective_rpc", json=body).status_code == 200
            client.post("/reset_prefix_cache")
        finally:
            client.post("/resume")


def test_a_full_weight_canary_takes_a_replica_and_leaves_it_on_rollback(
        vllm_server: RunningVLLM, second_server: VLLMServer, smollm2_path: Path, tmp_path: Path) -> None:
    """Canary promotion with full weights: the canary is reloaded into one replica of two, only the sessions
    assigned to it go there (and all of them do), a rollback reloads the incumbent into it, a promotion
    reloads the canary into the rest."""
    from tests.integration.test_publish import load_model, save_full
    from tracetrain.engines.vllm_publish import VLLMReloadPublisher
    from tracetrain.proxy.promotion import assigned_to_canary

    replicas = ReplicaSet([Replica(VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120)),
                           Replica(VLLMEngine(second_server.url, vllm_server.model_name, timeout=120))],
                          health_interval_s=0.5)
    publisher = ReplicaPublisher(replicas, [VLLMReloadPublisher(r.engine, smollm2_path) for r in replicas.replicas],
                                 canary_share=0.5)

    canary_dir, _ = save_full(load_model(smollm2_path), smollm2_path, tmp_path / "v1", seed=5)
    running = start_gateway(replicas, smollm2_path, f"sqlite:///{tmp_path / 'store.db'}", publisher=publisher,
                            promotion={"mode": "canary", "canary_share": 0.5, "min_sessions": 1000,
                                       "max_sessions": 1000})  # decided by hand here
    urls = [vllm_server.url, second_server.url]
    try:
        published = httpx.post(f"{running.url}/v1/policies", timeout=300,
                               json={"version": 1, "checkpoint": str(canary_dir), "kind": "full"})
        assert published.status_code == 200, published.text
        state = httpx.get(f"{running.url}/v1/replicas").json()
        assert [r["canary"] for r in state["data"]] == [False, True]
        assert [r["version"] for r in state["data"]] == [0, 1]

        sessions = [f"full-{i}" for i in range(12)]
        for session in sessions:
            response = chat(running, session, [{"role": "user", "content": "Hi"}], max_tokens=4)
            assert response.status_code == 200, response.text
            expected = 1 if assigned_to_canary(session, 0.5) else 0
            assert response.headers["X-Policy-Version"] == str(expected), session
        by_session = {c.session_id: c for c in stored_calls(running)}
        for session in sessions:  # each arm on its own replica
            call = by_session[session]
            assert call.request_params["replica"] == urls[call.policy_version], (session, call.request_params)
        assert {by_session[s].policy_version for s in sessions} == {0, 1}

        rolled = httpx.post(f"{running.url}/v1/policies/1/rollback", timeout=300)
        assert rolled.status_code == 200 and rolled.json()["served_version"] == 0, rolled.text
        state = httpx.get(f"{running.url}/v1/replicas").json()
        assert [(r["canary"], r["version"]) for r in state["data"]] == [(False, 0), (False, 0)]
        canary_session = next(s for s in sessions if by_session[s].policy_version == 1)
        again = chat(running, canary_session, [{"role": "user", "content": "Hi"}], max_tokens=4)
        assert again.headers["X-Policy-Version"] == "0"

        assert httpx.post(f"{running.url}/v1/policies", timeout=300,
                          json={"version": 2, "checkpoint": str(canary_dir), "kind": "full"}).status_code == 200
        promoted = httpx.post(f"{running.url}/v1/policies/2/promote", timeout=300)
        assert promoted.status_code == 200 and promoted.json()["served_version"] == 2, promoted.text
        state = httpx.get(f"{running.url}/v1/replicas").json()
        assert [(r["canary"], r["version"]) for r in state["data"]] == [(False, 2), (False, 2)]
    finally:
        running.stop()
        for url in urls:
            _reload_base(url, smollm2_path)
