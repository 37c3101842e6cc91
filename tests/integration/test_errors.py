"""Every bad input gets the right status and an OpenAI-format error, over real HTTP, and loses nothing
that was already recorded: each test first records a call and a reward in a session, sends the bad
input, then reads the session back."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, free_port, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.engines.vllm import VLLMEngine

MODEL = "tiny"
SESSION = "keep"
HELLO = [{"role": "user", "content": "hi"}]
LIMIT = 4096


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra}


def _assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["code"], str) and error["code"]
    if code is not None:
        assert error["code"] == code, error
    if status in (400, 413):
        assert error["type"] == "invalid_request_error"
    if status >= 500:
        assert error["type"] == "server_error"
    return error  # type: ignore[no-any-return]


def _record(gw: RunningGateway, session: str = SESSION) -> dict[str, Any]:
    """One successful call and one reward in `session`; returns what GET /v1/sessions/{id} says."""
    response = httpx.post(f"{gw.v1(session)}/chat/completions", json=_chat(), timeout=30)
    assert response.status_code == 200, response.text
    reward = httpx.post(f"{gw.url}/v1/rewards", json={"session_id": session, "reward": 0.5}, timeout=30)
    assert reward.status_code == 200, reward.text
    return _session(gw, session)


def _session(gw: RunningGateway, session: str = SESSION) -> dict[str, Any]:
    response = httpx.get(f"{gw.url}/v1/sessions/{session}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _assert_intact(gw: RunningGateway, before: dict[str, Any], session: str = SESSION) -> None:
    after = _session(gw, session)
    assert [c["id"] for c in after["calls"]] == [c["id"] for c in before["calls"]]
    assert [(r["id"], r["value"]) for r in after["rewards"]] == [(r["id"], r["value"]) for r in before["rewards"]]


@pytest.fixture
def gw(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """The tiny model behind a gateway; the wrapper keeps the module's engine open when the gateway stops."""
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'gw.db'}",
                            max_body_bytes=LIMIT)
    yield running
    running.stop()


@pytest.fixture
def recorded(gw: RunningGateway) -> dict[str, Any]:
    before = _record(gw)
    assert len(before["calls"]) == 1 and len(before["rewards"]) == 1
    return before


# --- chat requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", f"/s/{SESSION}/v1/chat/completions", "/v1/rewards"])
def test_malformed_json_is_400(gw: RunningGateway, recorded: dict[str, Any], path: str) -> None:
    response = httpx.post(gw.url + path, content=b'{"model": "tiny", "messages": [', timeout=30,
                          headers={"Content-Type": "application/json"})
    _assert_error(response, 400, "invalid_json")
    _assert_intact(gw, recorded)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_wrong_types_are_400(gw: RunningGateway, recorded: dict[str, Any], change: dict[str, Any],
                             param: str) -> None:
    response = httpx.post(f"{gw.v1(SESSION)}/chat/completions", json=_chat(**change), timeout=30)
    error = _assert_error(response, 400, "invalid_value")
    assert error["param"].startswith(param)
    _assert_intact(gw, recorded)


def test_missing_messages_is_400(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    response = httpx.post(f"{gw.v1(SESSION)}/chat/completions", json={"model": MODEL}, timeout=30)
    error = _assert_error(response, 400, "invalid_value")
    assert error["param"] == "messages"
    _assert_intact(gw, recorded)


def test_unknown_model_is_404(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    response = httpx.post(f"{gw.v1(SESSION)}/chat/completions", json=_chat(model="gpt-9"), timeout=30)
    error = _assert_error(response, 404, "model_not_found")
    assert "gpt-9" in error["message"]
    _assert_intact(gw, recorded)


def test_oversized_body_with_content_length_is_413(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    body = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (2 * LIMIT)}])).encode()
    response = httpx.post(f"{gw.v1(SESSION)}/chat/completions", content=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert "content-length" in response.request.headers
    _assert_error(response, 413, "body_too_large")
    _assert_intact(gw, recorded)


def test_oversized_chunked_body_is_413(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    body = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (2 * LIMIT)}])).encode()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1024):
            yield body[start : start + 1024]

    response = httpx.post(f"{gw.v1(SESSION)}/chat/completions", content=chunks(), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    _assert_error(response, 413, "body_too_large")
    _assert_intact(gw, recorded)


# --- rewards ------------------------------------------------------------------------------------------


def test_reward_for_unknown_session_is_404(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    response = httpx.post(f"{gw.url}/v1/rewards", json={"session_id": "nobody", "reward": 1.0}, timeout=30)
    _assert_error(response, 404, "session_not_found")
    _assert_intact(gw, recorded)


def test_reward_for_unknown_completion_is_404(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    response = httpx.post(f"{gw.url}/v1/rewards", json={"completion_id": "chatcmpl-nope", "reward": 1.0},
                          timeout=30)
    _assert_error(response, 404, "completion_not_found")
    _assert_intact(gw, recorded)


@pytest.mark.parametrize(
    "reward", [b"NaN", b"Infinity", b"-Infinity", b'{"a": 1.0, "b": NaN}', b'{"a": -Infinity}', b"1e999"]
)
def test_non_finite_reward_is_400(gw: RunningGateway, recorded: dict[str, Any], reward: bytes) -> None:
    # Python's json module writes (and reads) NaN/Infinity literals: send the raw bytes a sloppy client would.
    body = b'{"session_id": "' + SESSION.encode() + b'", "reward": ' + reward + b"}"
    response = httpx.post(f"{gw.url}/v1/rewards", content=body, headers={"Content-Type": "application/json"},
                          timeout=30)
    error = _assert_error(response, 400)
    assert "finite" in error["message"]
    _assert_intact(gw, recorded)


def test_empty_reward_dict_is_400(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    response = httpx.post(f"{gw.url}/v1/rewards", json={"session_id": SESSION, "reward": {}}, timeout=30)
    _assert_error(response, 400, "invalid_value")
    _assert_intact(gw, recorded)


def test_reward_without_target_is_400(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    response = httpx.post(f"{gw.url}/v1/rewards", json={"reward": 1.0}, timeout=30)
    _assert_error(response, 400, "missing_target")
    _assert_intact(gw, recorded)


def test_idempotency_key_replay_and_conflict(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    payload = {"session_id": SESSION, "reward": {"a": 1.0, "b": 0.5}, "idempotency_key": "k1", "final": True}
    first = httpx.post(f"{gw.url}/v1/rewards", json=payload, timeout=30)
    assert first.status_code == 200, first.text
    assert first.json()["duplicate"] is False
    again = httpx.post(f"{gw.url}/v1/rewards", json=payload, timeout=30)
    assert again.status_code == 200, again.text
    assert again.json()["duplicate"] is True
    assert again.json()["id"] == first.json()["id"]
    conflict = httpx.post(f"{gw.url}/v1/rewards", json={**payload, "reward": {"a": 2.0, "b": 0.5}}, timeout=30)
    _assert_error(conflict, 409, "idempotency_conflict")
    rewards = _session(gw)["rewards"]
    assert [r["idempotency_key"] for r in rewards] == [None, "k1"], "stored exactly once"
    assert rewards[1]["value"] == 1.5 and rewards[1]["components"] == {"a": 1.0, "b": 0.5}
    assert len(_session(gw)["calls"]) == 1


# --- engine failures ----------------------------------------------------------------------------------


@pytest.fixture
def hung_engine_url() -> Iterator[str]:
    """A TCP server that accepts connections and never answers: what a hung engine looks like."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


def _restart_on(gw: RunningGateway, engine: VLLMEngine, tiny_model_path: Path, **config: Any) -> RunningGateway:
    """Stop `gw` and serve its store again in front of `engine` (a restart with a broken engine)."""
    gw.stop()
    return start_gateway(engine, tiny_model_path, gw.gateway.config.db_url, **config)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_down_is_503(gw: RunningGateway, recorded: dict[str, Any], tiny_model_path: Path,
                            stream: bool) -> None:
    dead = VLLMEngine(f"http://127.0.0.1:{free_port()}", model_name=MODEL)  # nothing listens there
    down = _restart_on(gw, dead, tiny_model_path)
    try:
        # A stream answers with a status too: the gateway waits for the first token before sending headers.
        response = httpx.post(f"{down.v1(SESSION)}/chat/completions", json=_chat(stream=stream), timeout=30)
        _assert_error(response, 503, "engine_unavailable")
        _assert_intact(down, recorded)
    finally:
        down.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_engine_timeout_is_504(gw: RunningGateway, recorded: dict[str, Any], tiny_model_path: Path,
                               hung_engine_url: str, stream: bool) -> None:
    hung = VLLMEngine(hung_engine_url, model_name=MODEL)
    slow = _restart_on(gw, hung, tiny_model_path, engine_timeout_s=0.5)
    try:
        response = httpx.post(f"{slow.v1(SESSION)}/chat/completions", json=_chat(stream=stream), timeout=30)
        _assert_error(response, 504, "engine_timeout")
        _assert_intact(slow, recorded)
    finally:
        slow.stop()


# --- the OpenAI SDK -----------------------------------------------------------------------------------


def _sdk(gw: RunningGateway, session: str = SESSION) -> OpenAI:
    return OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=0)


def test_sdk_raises_matching_exceptions(gw: RunningGateway, recorded: dict[str, Any]) -> None:
    client = _sdk(gw)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
    assert not_found.value.status_code == 404 and not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=0)  # type: ignore[arg-type]
    assert bad.value.code == "invalid_value" and bad.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=7)  # type: ignore[arg-type]
    with pytest.raises(openai.APIStatusError) as too_large:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "x" * (2 * LIMIT)}])
    assert too_large.value.status_code == 413 and too_large.value.code == "body_too_large"
    with pytest.raises(openai.NotFoundError):
        client.post("/rewards", cast_to=object, body={"completion_id": "chatcmpl-nope", "reward": 1.0})
    client.post("/rewards", cast_to=object, body={"session_id": SESSION, "reward": 1.0, "idempotency_key": "k"})
    with pytest.raises(openai.ConflictError):
        client.post("/rewards", cast_to=object, body={"session_id": SESSION, "reward": 2.0, "idempotency_key": "k"})
    assert len(_session(gw)["calls"]) == 1 and len(_session(gw)["rewards"]) == 2


def test_sdk_raises_server_errors_for_a_dead_engine(gw: RunningGateway, recorded: dict[str, Any],
                                                    tiny_model_path: Path) -> None:
    dead = VLLMEngine(f"http://127.0.0.1:{free_port()}", model_name=MODEL)
    down = _restart_on(gw, dead, tiny_model_path)
    try:
        client = _sdk(down)
        with pytest.raises(openai.InternalServerError) as plain:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        assert plain.value.status_code == 503 and plain.value.code == "engine_unavailable"
        with pytest.raises(openai.InternalServerError) as streamed:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True)  # type: ignore[arg-type]
        assert streamed.value.status_code == 503
        _assert_intact(down, recorded)
    finally:
        down.stop()
