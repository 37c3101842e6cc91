"""Every bad input gets the right status and an OpenAI-format error, over real HTTP, and loses nothing
that was already recorded: each test first records a call and a reward in a session of its own, sends
the bad input, then reads the session back."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, free_port, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.engines.vllm import VLLMEngine

MODEL = "tiny"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
LIMIT = 4096
JSON = {"Content-Type": "application/json"}


@dataclass
class Recorded:
    """A session holding one call and one reward, and what GET /v1/sessions/{id} said about it."""

    gw: RunningGateway
    session: str
    before: dict[str, Any]

    @property
    def chat_url(self) -> str:
        return f"{self.gw.v1(self.session)}/chat/completions"

    def assert_intact(self) -> None:
        after = _session(self.gw, self.session)
        assert [c["id"] for c in after["calls"]] == [c["id"] for c in self.before["calls"]]
        assert [(r["id"], r["value"]) for r in after["rewards"]] == [
            (r["id"], r["value"]) for r in self.before["rewards"]
        ]


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


def _session(gw: RunningGateway, session: str) -> dict[str, Any]:
    response = httpx.get(f"{gw.url}/v1/sessions/{session}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _record(gw: RunningGateway, session: str) -> Recorded:
    response = httpx.post(f"{gw.v1(session)}/chat/completions", json=_chat(), timeout=30)
    assert response.status_code == 200, response.text
    reward = httpx.post(f"{gw.url}/v1/rewards", json={"session_id": session, "reward": 0.5}, timeout=30)
    assert reward.status_code == 200, reward.text
    before = _session(gw, session)
    assert len(before["calls"]) == 1 and len(before["rewards"]) == 1
    return Recorded(gw, session, before)


def _start(engine: Any, tiny_model_path: Path, db_url: str, **engine_settings: Any) -> RunningGateway:
    if isinstance(engine, TransformersEngine):
        engine = RecordingEngine(engine)  # its close() leaves the module's engine open when a gateway stops
    return start_gateway(engine, tiny_model_path, db_url, gateway={"max_body_bytes": LIMIT}, engine=engine_settings)


@pytest.fixture(scope="module")
def gw(
    tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    """One gateway for the module: each test works in a session of its own."""
    running = _start(tiny_engine, tiny_model_path, f"sqlite:///{tmp_path_factory.mktemp('errors') / 'gw.db'}")
    yield running
    running.stop()


@pytest.fixture
def rec(gw: RunningGateway) -> Recorded:
    return _record(gw, f"keep-{uuid.uuid4().hex[:8]}")


# --- chat requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/s/{session}/v1/chat/completions", "/v1/rewards"])
def test_malformed_json_is_400(rec: Recorded, path: str) -> None:
    url = rec.gw.url + path.format(session=rec.session)
    response = httpx.post(url, content=b'{"model": "tiny", "messages": [', headers=JSON, timeout=30)
    _assert_error(response, 400, "invalid_json")
    rec.assert_intact()


@pytest.mark.parametrize("body", [b"", b"[]", b"null", b'"hi"', b"\xff\xfe{}"])
def test_body_that_is_not_a_json_object_is_400(rec: Recorded, body: bytes) -> None:
    _assert_error(httpx.post(rec.chat_url, content=body, headers=JSON, timeout=30), 400)
    rec.assert_intact()


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
def test_wrong_types_are_400(rec: Recorded, change: dict[str, Any], param: str) -> None:
    response = httpx.post(rec.chat_url, json=_chat(**change), timeout=30)
    error = _assert_error(response, 400, "invalid_value")
    assert error["param"].startswith(param)
    rec.assert_intact()


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"tool_choice": "required"}, "invalid_tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "invalid_tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid_tool_choice"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "invalid_tools"),
        ({"response_format": {"type": "yaml"}}, "invalid_response_format"),
        ({"response_format": {"type": "json_schema"}}, "invalid_response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "invalid_response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}}, "invalid_tool_choice"),
    ],
)
def test_bad_tool_choice_and_response_format_are_400(rec: Recorded, change: dict[str, Any], code: str) -> None:
    _assert_error(httpx.post(rec.chat_url, json=_chat(**change), timeout=30), 400, code)
    rec.assert_intact()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("change", [{"tools": TOOLS, "tool_choice": "required"},
                                    {"response_format": {"type": "json_object"}}])
def test_constraints_the_engine_cannot_enforce_are_refused(rec: Recorded, change: dict[str, Any],
                                                           stream: bool) -> None:
    """The in-process engine has no constrained decoding: unconstrained text would break the promise."""
    response = httpx.post(rec.chat_url, json=_chat(stream=stream, **change), timeout=30)
    _assert_error(response, 400, "unsupported_parameter")
    rec.assert_intact()


def test_missing_messages_is_400(rec: Recorded) -> None:
    response = httpx.post(rec.chat_url, json={"model": MODEL}, timeout=30)
    error = _assert_error(response, 400, "invalid_value")
    assert error["param"] == "messages"
    rec.assert_intact()


def test_unknown_model_is_404(rec: Recorded) -> None:
    response = httpx.post(rec.chat_url, json=_chat(model="gpt-9"), timeout=30)
    error = _assert_error(response, 404, "model_not_found")
    assert "gpt-9" in error["message"]
    rec.assert_intact()


def _too_large() -> bytes:
    return json.dumps(_chat(messages=[{"role": "user", "content": "x" * (2 * LIMIT)}])).encode()


def test_oversized_body_with_content_length_is_413(rec: Recorded) -> None:
    response = httpx.post(rec.chat_url, content=_too_large(), headers=JSON, timeout=30)
    assert "content-length" in response.request.headers
    _assert_error(response, 413, "body_too_large")
    rec.assert_intact()


def test_oversized_chunked_body_is_413(rec: Recorded) -> None:
    body = _too_large()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1024):
            yield body[start : start + 1024]

    response = httpx.post(rec.chat_url, content=chunks(), headers=JSON, timeout=30)
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    _assert_error(response, 413, "body_too_large")
    rec.assert_intact()


# --- rewards ------------------------------------------------------------------------------------------


def _reward(rec: Recorded, **body: Any) -> httpx.Response:
    return httpx.post(f"{rec.gw.url}/v1/rewards", json=body, timeout=30)


def test_reward_for_unknown_session_is_404(rec: Recorded) -> None:
    _assert_error(_reward(rec, session_id="nobody", reward=1.0), 404, "session_not_found")
    rec.assert_intact()


def test_reward_for_unknown_completion_is_404(rec: Recorded) -> None:
    _assert_error(_reward(rec, completion_id="chatcmpl-nope", reward=1.0), 404, "completion_not_found")
    rec.assert_intact()


@pytest.mark.parametrize(
    "reward", [b"NaN", b"Infinity", b"-Infinity", b'{"a": 1.0, "b": NaN}', b'{"a": -Infinity}', b"1e999"]
)
def test_non_finite_reward_is_400(rec: Recorded, reward: bytes) -> None:
    # Python's json module writes (and reads) NaN/Infinity literals: send the raw bytes such a client sends.
    body = b'{"session_id": "' + rec.session.encode() + b'", "reward": ' + reward + b"}"
    response = httpx.post(f"{rec.gw.url}/v1/rewards", content=body, headers=JSON, timeout=30)
    error = _assert_error(response, 400)
    assert "finite" in error["message"]
    rec.assert_intact()


def test_empty_reward_dict_is_400(rec: Recorded) -> None:
    _assert_error(_reward(rec, session_id=rec.session, reward={}), 400, "invalid_value")
    rec.assert_intact()


def test_reward_without_target_is_400(rec: Recorded) -> None:
    _assert_error(_reward(rec, reward=1.0), 400, "missing_target")
    rec.assert_intact()


def test_idempotency_key_replay_and_conflict(rec: Recorded) -> None:
    payload = {
        "session_id": rec.session,
        "reward": {"a": 1.0, "b": 0.5},
        "idempotency_key": "k1",
        "final": True,
    }
    first = _reward(rec, **payload)
    assert first.status_code == 200, first.text
    assert first.json()["duplicate"] is False
    again = _reward(rec, **payload)
    assert again.status_code == 200, again.text
    assert again.json()["duplicate"] is True
    assert again.json()["id"] == first.json()["id"]
    _assert_error(_reward(rec, **{**payload, "reward": {"a": 2.0, "b": 0.5}}), 409, "idempotency_conflict")
    after = _session(rec.gw, rec.session)
    assert [r["idempotency_key"] for r in after["rewards"]] == [None, "k1"], "stored exactly once"
    assert after["rewards"][1]["value"] == 1.5
    assert after["rewards"][1]["components"] == {"a": 1.0, "b": 0.5}
    assert len(after["calls"]) == 1


async def test_concurrent_replays_of_one_key_store_one_reward(rec: Recorded) -> None:
    async with httpx.AsyncClient(base_url=rec.gw.url, timeout=30) as client:
        same = {"session_id": rec.session, "reward": 1.0, "idempotency_key": "same"}
        replies = await asyncio.gather(*(client.post("/v1/rewards", json=same) for _ in range(8)))
        assert [r.status_code for r in replies] == [200] * 8
        assert sorted(r.json()["duplicate"] for r in replies) == [False] + [True] * 7
        assert len({r.json()["id"] for r in replies}) == 1
        keys = [
            {"session_id": rec.session, "reward": float(i), "idempotency_key": "differ"} for i in range(8)
        ]
        replies = await asyncio.gather(*(client.post("/v1/rewards", json=body) for body in keys))
        assert sorted(r.status_code for r in replies) == [200] + [409] * 7
    keys_stored = [r["idempotency_key"] for r in _session(rec.gw, rec.session)["rewards"]]
    assert sorted(keys_stored, key=str) == sorted([None, "same", "differ"], key=str)


# --- unsupported methods -------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("PUT", "/v1/chat/completions", "POST"),
    ("DELETE", "/s/{session}/v1/rewards", "POST"),
    ("PUT", "/v1/sessions/{session}/reward_override", "DELETE, POST"),
    ("POST", "/v1/sessions/{session}", "DELETE, GET"),
    ("GET", "/v1/messages/count_tokens", "POST"),
])
def test_a_method_a_path_lacks_is_405_naming_the_methods_it_has(rec: Recorded, method: str, path: str,
                                                                  allowed: str) -> None:
    """RFC 9110: a 405 carries `Allow`, with every method of the path (a path may have several routes)."""
    response = httpx.request(method, rec.gw.url + path.format(session=rec.session), timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == allowed, response.headers
    if path.endswith("count_tokens"):
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    else:
        _assert_error(response, 405, "http_error")
    rec.assert_intact()


# --- policies -----------------------------------------------------------------------------------------


@pytest.fixture
def publishing(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[Recorded]:
    """A gateway with a publisher (as `serve --train` has), and a session it recorded."""
    from tracetrain.engines.transformers_publish import InProcessPublisher
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'pub.db'}",
                            publisher=InProcessPublisher(tiny_engine))
    yield _record(running, "keep-publishing")
    running.stop()


@pytest.mark.parametrize(("checkpoint", "kind", "status", "code"), [
    ("", "full", 400, "invalid_value"),  # was a 502: the publisher read the gateway's working directory
    (".", "full", 404, "checkpoint_not_found"),
    ("{empty}", "lora", 404, "checkpoint_not_found"),
    ("{missing}", "full", 404, "checkpoint_not_found"),
])
def test_a_checkpoint_that_is_not_there_is_a_4xx(publishing: Recorded, tmp_path: Path, checkpoint: str, kind: str,
                                                  status: int, code: str) -> None:
    (tmp_path / "empty").mkdir()
    path = checkpoint.format(empty=tmp_path / "empty", missing=tmp_path / "missing")
    response = httpx.post(f"{publishing.gw.url}/v1/policies", json={"version": 1, "checkpoint": path, "kind": kind},
                          timeout=60)
    error = _assert_error(response, status, code)
    assert error["param"] == "checkpoint"
    assert httpx.get(f"{publishing.gw.url}/v1/policies", timeout=30).json()["served_version"] == 0
    publishing.assert_intact()


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

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


Restart = Callable[..., Recorded]


@pytest.fixture
def restart_on(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[Restart]:
    """Record a session with the working engine, then serve the same store in front of a broken one
    (the gateway restarted while its engine is down or hung)."""
    started: list[RunningGateway] = []

    def restart(engine: VLLMEngine, **engine_settings: Any) -> Recorded:
        db_url = f"sqlite:///{tmp_path / 'broken.db'}"
        working = _start(tiny_engine, tiny_model_path, db_url)
        rec = _record(working, "keep")
        working.stop()
        started.append(_start(engine, tiny_model_path, db_url, **engine_settings))
        return Recorded(started[-1], rec.session, rec.before)

    yield restart
    for running in started:
        running.stop()


def _dead_engine() -> VLLMEngine:
    return VLLMEngine(f"http://127.0.0.1:{free_port()}", model_name=MODEL)  # nothing listens there


@pytest.mark.parametrize("stream", [False, True])
def test_engine_down_is_503(restart_on: Restart, stream: bool) -> None:
    rec = restart_on(_dead_engine())
    # A stream gets a status too: the gateway waits for the first token before it sends headers.
    response = httpx.post(rec.chat_url, json=_chat(stream=stream), timeout=30)
    _assert_error(response, 503, "engine_unavailable")
    rec.assert_intact()


@pytest.mark.parametrize("stream", [False, True])
def test_engine_timeout_is_504(restart_on: Restart, hung_engine_url: str, stream: bool) -> None:
    rec = restart_on(VLLMEngine(hung_engine_url, model_name=MODEL), timeout_s=0.5)
    response = httpx.post(rec.chat_url, json=_chat(stream=stream), timeout=30)
    _assert_error(response, 504, "engine_timeout")
    rec.assert_intact()


# --- the OpenAI SDK -----------------------------------------------------------------------------------


def _sdk(rec: Recorded) -> OpenAI:
    return OpenAI(base_url=rec.gw.v1(rec.session), api_key="unused", max_retries=0)


def test_sdk_raises_matching_exceptions(rec: Recorded) -> None:
    client = _sdk(rec)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=2)
    assert not_found.value.status_code == 404 and not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=0)
    assert bad.value.code == "invalid_value" and bad.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=7)
    with pytest.raises(openai.APIStatusError) as too_large:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * (2 * LIMIT)}], max_tokens=2
        )
    assert too_large.value.status_code == 413 and too_large.value.code == "body_too_large"
    with pytest.raises(openai.NotFoundError):
        client.post("/rewards", cast_to=object, body={"completion_id": "chatcmpl-nope", "reward": 1.0})
    key = {"session_id": rec.session, "idempotency_key": "k"}
    client.post("/rewards", cast_to=object, body={**key, "reward": 1.0})
    with pytest.raises(openai.ConflictError):
        client.post("/rewards", cast_to=object, body={**key, "reward": 2.0})
    after = _session(rec.gw, rec.session)
    assert len(after["calls"]) == 1 and len(after["rewards"]) == 2


def test_sdk_raises_server_errors_for_a_dead_engine(restart_on: Restart) -> None:
    rec = restart_on(_dead_engine())
    client = _sdk(rec)
    with pytest.raises(openai.InternalServerError) as plain:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert plain.value.status_code == 503 and plain.value.code == "engine_unavailable"
    with pytest.raises(openai.InternalServerError) as streamed:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True)
    assert streamed.value.status_code == 503
    rec.assert_intact()
