"""API keys over real HTTP: agent keys own the sessions they create, the admin key sees everything,
no key (or a wrong one) gets 401; without keys the gateway is open, and only on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.config import Config, GatewayConfig
from tracetrain.engines.transformers_engine import TransformersEngine

MODEL = "tiny"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
ADMIN = {"Authorization": "Bearer admin"}
AGENT_A = {"Authorization": "Bearer agent-a"}
AGENT_B = {"Authorization": "Bearer agent-b"}


@pytest.fixture(scope="module")
def keyed(
    tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    db_url = f"sqlite:///{tmp_path_factory.mktemp('access') / 'gw.db'}"
    running = start_gateway(
        RecordingEngine(tiny_engine),
        tiny_model_path,
        db_url,
        gateway={"api_keys": ["agent-a", "agent-b"], "admin_key": "admin"},
    )
    yield running
    running.stop()


def _sdk(gw: RunningGateway, key: str, session: str | None = None) -> OpenAI:
    return OpenAI(base_url=gw.v1(session), api_key=key, max_retries=0)


def _create(gw: RunningGateway, key: str, session: str | None) -> str:
    """One call by `key` in `session` (bound by the URL path); returns its completion id."""
    reply = _sdk(gw, key, session).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    return reply.id


def _error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def _get(gw: RunningGateway, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(gw.url + path, headers=headers, timeout=30)


def _post(
    gw: RunningGateway, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=30)


def test_missing_or_wrong_key_is_401(keyed: RunningGateway) -> None:
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    for headers, code in ((None, "missing_api_key"), ({"Authorization": "Bearer nope"}, "invalid_api_key")):
        _error(_post(keyed, "/s/x/v1/chat/completions", chat, headers), 401, code)
        _error(_post(keyed, "/v1/chat/completions", chat, headers), 401, code)
        _error(_post(keyed, "/v1/rewards", {"session_id": "x", "reward": 1}, headers), 401, code)
        _error(_get(keyed, "/v1/sessions/x", headers), 401, code)
        _error(_get(keyed, "/v1/sessions", headers), 401, code)
        _error(_get(keyed, "/v1/export", headers), 401, code)
        _error(_get(keyed, "/v1/models", headers), 401, code)
    _error(
        _post(keyed, "/v1/chat/completions", chat, {"Authorization": "Basic YWdlbnQtYTo="}),
        401,
        "missing_api_key",
    )
    with pytest.raises(openai.AuthenticationError):
        _create(keyed, "wrong", "x")
    assert _get(keyed, "/v1/sessions/x", ADMIN).status_code == 404, "refused calls create nothing"


def test_agent_owns_its_sessions(keyed: RunningGateway) -> None:
    completion = _create(keyed, "agent-a", "a-own")
    session = _get(keyed, "/v1/sessions/a-own", AGENT_A)
    assert session.status_code == 200 and len(session.json()["calls"]) == 1
    assert _get(keyed, "/v1/sessions/a-own/trajectory", AGENT_A).status_code == 200
    reward = _post(keyed, "/v1/rewards", {"session_id": "a-own", "reward": 1.0}, AGENT_A)
    assert reward.status_code == 200, reward.text
    by_completion = _post(keyed, "/v1/rewards", {"completion_id": completion, "reward": 0.5}, AGENT_A)
    assert by_completion.status_code == 200, by_completion.text
    on_path = _post(keyed, "/s/a-own/v1/rewards", {"reward": 0.25}, AGENT_A)
    assert on_path.status_code == 200, on_path.text
    _create(keyed, "agent-a", "a-own")  # A may go on writing into its own session
    assert len(_get(keyed, "/v1/sessions/a-own", AGENT_A).json()["calls"]) == 2


def test_other_agent_gets_403(keyed: RunningGateway) -> None:
    completion = _create(keyed, "agent-a", "a-private")
    _post(keyed, "/v1/rewards", {"session_id": "a-private", "reward": 1.0}, AGENT_A).raise_for_status()
    _error(_get(keyed, "/v1/sessions/a-private", AGENT_B), 403, "session_forbidden")
    _error(_get(keyed, "/v1/sessions/a-private/trajectory", AGENT_B), 403, "session_forbidden")
    _error(
        _post(keyed, "/v1/rewards", {"session_id": "a-private", "reward": -1.0}, AGENT_B),
        403,
        "session_forbidden",
    )
    _error(
        _post(keyed, "/v1/rewards", {"completion_id": completion, "reward": -1.0}, AGENT_B),
        403,
        "session_forbidden",
    )
    _error(_post(keyed, "/s/a-private/v1/rewards", {"reward": -1.0}, AGENT_B), 403, "session_forbidden")
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _create(keyed, "agent-b", "a-private")  # writing a call into A's session
    assert refused.value.code == "session_forbidden"
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    _error(
        _post(keyed, "/v1/chat/completions", chat, {**AGENT_B, "X-Session-Id": "a-private"}),
        403,
        "session_forbidden",
    )
    session = _get(keyed, "/v1/sessions/a-private", AGENT_A).json()
    assert len(session["calls"]) == 1 and [r["value"] for r in session["rewards"]] == [1.0], (
        "B changed nothing"
    )


def test_unbound_calls_belong_to_their_key(keyed: RunningGateway) -> None:
    completion = _create(keyed, "agent-a", None)
    assert _get(keyed, f"/v1/sessions/{completion}", AGENT_A).status_code == 200
    _error(_get(keyed, f"/v1/sessions/{completion}", AGENT_B), 403, "session_forbidden")


def test_export_needs_the_admin_key_and_agents_list_only_their_sessions(keyed: RunningGateway) -> None:
    _create(keyed, "agent-a", "a-export")
    _create(keyed, "agent-b", "b-listed")
    _error(_get(keyed, "/v1/export", AGENT_A), 403, "admin_required")
    with pytest.raises(openai.PermissionDeniedError):
        _sdk(keyed, "agent-a").get("/export", cast_to=object)
    for agent, mine, theirs in ((AGENT_A, "a-export", "b-listed"), (AGENT_B, "b-listed", "a-export")):
        seen = {s["id"] for s in _get(keyed, "/v1/sessions", agent).json()["data"]}
        assert mine in seen and theirs not in seen
    listed = _get(keyed, "/v1/sessions", ADMIN)
    assert listed.status_code == 200
    assert {"a-export", "b-listed"} <= {s["id"] for s in listed.json()["data"]}
    exported = _get(keyed, "/v1/export", ADMIN)
    assert exported.status_code == 200
    for path in ("/v1/generation/hold", "/v1/generation/release"):
        _error(httpx.post(f"{keyed.url}{path}", headers=AGENT_A, json={}, timeout=30), 403, "admin_required")
    assert exported.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in exported.text.splitlines()]
    mine = [r for r in rows if r["session_id"] == "a-export"]
    assert len(mine) == 1 and sum(mine[0]["loss_mask"]) == 2
    session = _get(keyed, "/v1/sessions/a-export", ADMIN)
    assert session.status_code == 200 and len(session.json()["calls"]) == 1
    assert _post(keyed, "/v1/rewards", {"session_id": "a-export", "reward": 1.0}, ADMIN).status_code == 200


@pytest.fixture
def gateway(
    tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path
) -> Iterator[RunningGateway]:
    """A gateway without keys; the wrapper keeps the module's engine open when it stops."""
    running = start_gateway(
        RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'open.db'}"
    )
    yield running
    running.stop()


def test_without_keys_loopback_is_open(gateway: RunningGateway) -> None:
    reply = OpenAI(base_url=gateway.v1("open-1"), api_key="anything").chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=2,
    )
    assert _get(gateway, "/v1/sessions/open-1").status_code == 200
    assert _post(gateway, "/v1/rewards", {"completion_id": reply.id, "reward": 1.0}).status_code == 200
    assert "open-1" in {s["id"] for s in _get(gateway, "/v1/sessions").json()["data"]}
    assert "open-1" in _get(gateway, "/v1/export").text
    assert _get(gateway, "/v1/models").status_code == 200


def test_non_loopback_host_requires_keys() -> None:
    with pytest.raises(SystemExit) as refused:
        Config(gateway={"host": "0.0.0.0"}).gateway.check_access()
    assert "gateway.api_keys" in str(refused.value) and "gateway.admin_key" in str(refused.value)
    with pytest.raises(SystemExit):
        GatewayConfig(host="0.0.0.0", api_keys=["a"]).check_access()  # agent keys without an admin key
    GatewayConfig(host="0.0.0.0", api_keys=["a"], admin_key="admin").check_access()
    GatewayConfig(host="127.0.0.1").check_access()
    GatewayConfig(host="localhost").check_access()
    GatewayConfig(host="::1").check_access()


def test_cli_refuses_a_public_host_without_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACETRAIN_")}
    started = time.monotonic()
    # -X importtime lists every module the CLI imported before giving up: no torch, no transformers.
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tracetrain.cli", "serve", "--host", "0.0.0.0",
         "--engine", "transformers", "--model", str(tmp_path / "no-such-model"), "--db-url",
         f"sqlite:///{tmp_path / 'x.db'}"],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    assert "refusing to bind 0.0.0.0" in result.stderr and "TRACETRAIN_GATEWAY__API_KEYS" in result.stderr
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert imported and not imported & {"torch", "transformers", "uvicorn"}, "refused before loading anything"
    assert not (tmp_path / "x.db").exists()
    assert time.monotonic() - started < 60


def test_anthropic_clients_authenticate_with_x_api_key(keyed: RunningGateway) -> None:
    import anthropic

    def client(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=f"{keyed.url}/s/as-key", api_key=key, max_retries=0)

    reply = client("agent-a").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert reply.id.startswith("msg_")
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        client("nope").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert wrong.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.PermissionDeniedError):  # the session belongs to agent-a
        client("agent-b").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(("setting", "allowed"), [
    ("none", {"no key": 200, "agent": 200, "admin": 200}),
    ("any", {"no key": 401, "agent": 200, "admin": 200}),
    ("admin", {"no key": 401, "agent": 403, "admin": 200}),
])
def test_metrics_are_as_open_as_the_metrics_key_setting(tiny_engine: TransformersEngine, tiny_model_path: Path,
                                                        tmp_path: Path, setting: str, allowed: dict[str, int]) -> None:
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'gw.db'}",
                            gateway={"api_keys": ["agent-a"], "admin_key": "admin", "metrics_key": setting})
    try:
        for who, headers in (("no key", {}), ("agent", AGENT_A), ("admin", ADMIN)):
            response = httpx.get(f"{running.url}/metrics", headers=headers, timeout=30)
            assert response.status_code == allowed[who], (setting, who, response.text)
            if response.status_code == 200:
                assert "tracetrain_requests_total" in response.text
            else:
                assert response.json()["error"]["code"] in ("missing_api_key", "admin_required")
    finally:
        running.stop()
