"""Canary promotion through a real gateway in front of the in-process tool model.

The reward is the agent's own check of the answer (did it call `add`?), as a real agent's would be. A
deliberately broken version (every weight of the model's last layers scaled by 40, so it writes
garbage) must be rolled back by the sequential test with no more than its share of sessions having
seen it; an unchanged copy must be promoted; an admin can promote or roll back a canary by hand.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from tests.support.servers import RunningGateway, free_port, start_gateway
from tests.support.tool_model import ADD_TOOL, QUESTION
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.proxy.promotion import assigned_to_canary
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession

# Each test runs up to 120 agent episodes, until the sequential test decides on the canary.
pytestmark = pytest.mark.slow

SHARE = 0.4


@pytest.fixture
def canary_gateway(tool_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    from tracetrain.engines.transformers_engine import TransformersEngine

    # Its own engine: the test publishes broken weights into it.
    engine = TransformersEngine(tool_model_path, model_name="tool-tiny")
    running = start_gateway(engine, tool_model_path, f"sqlite:///{tmp_path / 'canary.db'}",
                            publisher=InProcessPublisher(engine),
                            promotion={"mode": "canary", "canary_share": SHARE, "min_sessions": 6, "margin": 0.1})
    yield running
    running.stop()


def _checkpoint(tool_model_path: Path, target: Path, scale: float) -> Path:
    """A full checkpoint: the tool model, its last decoder layer and norm scaled by `scale`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tool_model_path, target)
    weights = target / "model.safetensors"
    state = load_file(str(weights))
    last = max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    for key in state:
        if key.startswith((f"model.layers.{last}.", "model.norm.")):
            state[key] = state[key] * scale
    save_file(state, str(weights), metadata={"format": "pt"})
    return target


def _episode(gateway: RunningGateway | str, session: str) -> tuple[int, float]:
    """One agent session: ask, check the answer, post the final reward. (version served, reward)"""
    url = gateway if isinstance(gateway, str) else gateway.url
    response = httpx.post(f"{url}/s/{session}/v1/chat/completions", timeout=60, json={
        "model": "tool-tiny", "messages": [{"role": "user", "content": QUESTION}], "tools": [ADD_TOOL],
        "temperature": 0, "max_tokens": 40})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    reward = 1.0 if calls and calls[0]["function"]["name"] == "add" else 0.0
    posted = httpx.post(f"{url}/v1/rewards", json={"session_id": session, "reward": reward, "final": True})
    assert posted.status_code == 200, posted.text
    return int(response.headers["X-Policy-Version"]), reward


def _policy(gateway: RunningGateway | str, version: int) -> dict[str, Any]:
    listing = httpx.get(f"{gateway if isinstance(gateway, str) else gateway.url}/v1/policies").json()
    return next(p for p in listing["data"] if p["version"] == version)


def _publish(gateway: RunningGateway | str, version: int, path: Path) -> httpx.Response:
    return httpx.post(f"{gateway if isinstance(gateway, str) else gateway.url}/v1/policies", timeout=120,
                      json={"version": version, "checkpoint": str(path), "kind": "full"})


def test_a_broken_version_is_rolled_back_and_only_its_share_saw_it(canary_gateway: RunningGateway,
                                                                      tool_model_path: Path, tmp_path: Path) -> None:
    broken = _checkpoint(tool_model_path, tmp_path / "broken", 40.0)
    assert _publish(canary_gateway, 1, broken).status_code == 200
    assert httpx.get(f"{canary_gateway.url}/v1/policies").json()["promotion"]["canary"]["version"] == 1
    served: dict[str, tuple[int, float]] = {}
    for i in range(120):
        session = f"s-{i}"  # fixed ids: which of them fall in the share is the same in every run
        served[session] = _episode(canary_gateway, session)
        if _policy(canary_gateway, 1)["promotion"] != "canary":
            break
    policy = _policy(canary_gateway, 1)
    assert policy["promotion"] == "rolled_back", policy
    decision = policy["decision"]
    print(f"\nbroken canary: {len(served)} sessions, decision {decision}")
    assert decision["by"] == "test" and decision["canary_n"] >= 6 and decision["incumbent_n"] >= 6
    assert decision["canary_mean"] < decision["incumbent_mean"] and decision["interval"][1] < -0.1
    # Exactly the sessions whose hash falls in the share saw the canary, and it failed them. The last one
    # may have been served while the rollback landed (the decision loop runs beside the calls): then the
    # incumbent answered it and says so, or the canary did and its session is set aside like the others.
    last = list(served)[-1]
    late = assigned_to_canary(last, SHARE) and served[last][0] == 0
    for session, (version, reward) in served.items():
        assert version == (1 if assigned_to_canary(session, SHARE) and not (late and session == last) else 0), session
        assert reward == (0.0 if version == 1 else 1.0)
    saw = sum(v == 1 for v, _ in served.values())
    # The hash gives the canary its share of sessions, no more: over many ids, and over these.
    population = [assigned_to_canary(f"s-{i}", SHARE) for i in range(10_000)]
    assert abs(sum(population) / len(population) - SHARE) < 0.015
    assert saw == sum(population[: len(served)]) - late
    # After the rollback no session gets it again, new or old.
    assert httpx.get(f"{canary_gateway.url}/v1/policies").json()["promotion"]["canary"] is None
    assert all(_episode(canary_gateway, f"after-{i}")[0] == 0 for i in range(5))
    canary_session = next(s for s, (v, _) in served.items() if v == 1)
    again = httpx.post(f"{canary_gateway.v1(canary_session)}/chat/completions", json={
        "model": "tool-tiny", "messages": [{"role": "user", "content": QUESTION}], "tools": [ADD_TOOL],
        "temperature": 0, "max_tokens": 40})
    assert again.headers["X-Policy-Version"] == "0"
    # Its sessions are kept but set aside from training.
    with Session(open_db(canary_gateway.gateway.config.store.url)) as db:
        rows = db.exec(select(AgentSession.id, AgentSession.skip_reason, AgentSession.policy_version)).all()
    assert {sid for sid, reason, v in rows if v == 1} == {s for s, (v, _) in served.items() if v == 1}
    assert all(reason == "rolled_back" for _, reason, v in rows if v == 1)
    assert all(reason is None for _, reason, v in rows if v == 0)
    counts = httpx.get(f"{canary_gateway.url}/v1/policies").json()["sessions"]["set_aside"]
    assert counts.get("rolled_back") == saw


def test_a_sound_version_is_promoted_and_admins_decide_by_hand(canary_gateway: RunningGateway,
                                                               tool_model_path: Path, tmp_path: Path) -> None:
    same = _checkpoint(tool_model_path, tmp_path / "same", 1.0)
    assert _publish(canary_gateway, 1, same).status_code == 200
    for i in range(120):
        _episode(canary_gateway, f"a-{i}")
        if _policy(canary_gateway, 1)["promotion"] != "canary":
            break
    policy = _policy(canary_gateway, 1)
    assert policy["promotion"] == "promoted" and policy["decision"]["difference"] == 0.0, policy
    assert _episode(canary_gateway, "after-promotion")[0] == 1

    # By hand: version 2 rolled back, version 3 promoted; anything else is a 409 in OpenAI's shape.
    assert _publish(canary_gateway, 2, same).status_code == 200
    busy = _publish(canary_gateway, 3, same)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "canary_on_trial"
    wrong = httpx.post(f"{canary_gateway.url}/v1/policies/1/rollback")
    assert wrong.status_code == 409 and wrong.json()["error"]["code"] == "not_a_canary"
    done = httpx.post(f"{canary_gateway.url}/v1/policies/2/rollback", json={"note": "looks off"})
    assert done.status_code == 200 and done.json() == {"version": 2, "promotion": "rolled_back", "served_version": 1}
    assert httpx.post(f"{canary_gateway.url}/v1/policies/2/promote").status_code == 409
    assert _policy(canary_gateway, 2)["decision"]["note"] == "looks off"
    assert _publish(canary_gateway, 3, same).status_code == 200
    promoted = httpx.post(f"{canary_gateway.url}/v1/policies/3/promote")
    assert promoted.status_code == 200 and promoted.json()["served_version"] == 3
    assert _episode(canary_gateway, "after-hand-promotion")[0] == 3
    bad_body = httpx.post(f"{canary_gateway.url}/v1/policies/3/promote", json={"note": 5})
    assert bad_body.status_code == 400 and "error" in bad_body.json()


def _serve(model: Path, db_url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "tracetrain.cli", "serve", "--engine", "transformers", "--model", str(model),
               "--served-model-name", "tool-tiny", "--db-url", db_url, "--port", str(port),
               "--set", "promotion.mode=canary", "--set", f"promotion.canary_share={SHARE}",
               "--set", "promotion.min_sessions=6", "--set", "promotion.margin=0.1"]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("gateway did not become healthy")


def test_gateway_processes_on_one_store_serve_and_drop_the_canary_together(tool_model_path: Path,
                                                                           tmp_path: Path) -> None:
    """Two `tracetrain serve` processes: the canary published through one is staged by the other from the
    store; whichever decides, both stop serving it."""
    db_url = f"sqlite:///{tmp_path / 'shared.db'}"
    started = [_serve(tool_model_path, db_url, tmp_path / f"gateway-{name}.log") for name in "ab"]
    a, b = (url for _, url in started)
    try:
        assert _publish(a, 1, _checkpoint(tool_model_path, tmp_path / "broken", 40.0)).status_code == 200
        deadline = time.monotonic() + 30
        while httpx.get(f"{b}/v1/policies").json()["promotion"]["canary"] is None:
            assert time.monotonic() < deadline, "the second process did not stage the canary"
            time.sleep(0.5)
        served: dict[str, tuple[str, int]] = {}
        for i in range(120):
            url = (a, b)[i % 2]
            session = f"p-{i}"  # fixed ids: the same sessions fall in the share every run
            served[session] = (url, _episode(url, session)[0])
            if _policy(a, 1)["promotion"] != "canary":
                break
        assert _policy(b, 1)["promotion"] == "rolled_back"
        assert {url for url, version in served.values() if version == 1} == {a, b}  # both served it
        time.sleep(2)  # the other process mirrors the decision within a second
        for url in (a, b):
            assert httpx.get(f"{url}/v1/policies").json()["promotion"]["canary"] is None
            assert all(_episode(url, f"after-{url[-5:]}-{i}")[0] == 0 for i in range(3))
    finally:
        for process, _ in started:
            process.terminate()
        for process, _ in started:
            process.wait(timeout=30)
