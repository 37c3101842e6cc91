"""Session and group binding through the real OpenAI SDK, configured as a user would (base_url,
default_headers, metadata, user): the most explicit source wins."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine

MODEL = "tiny"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(
    tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    """One gateway for the module (every test uses ids of its own); the wrapper keeps the engine open."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp('binding') / 'gw.db'}"
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, db_url)
    yield running
    running.stop()


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _call(
    gw: RunningGateway,
    session: str | None = None,
    group: str | None = None,
    headers: dict[str, str] | None = None,
    messages: list[ChatCompletionMessageParam] = HELLO,
    **extra: Any,
) -> tuple[str, Mapping[str, str]]:
    """One call through the SDK; returns the completion id and the response headers."""
    client = OpenAI(base_url=gw.v1(session, group), api_key="unused", default_headers=headers, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        **extra,
    )
    return raw.parse().id, raw.headers


def _session(gw: RunningGateway, session: str) -> dict[str, Any] | None:
    response = httpx.get(f"{gw.url}/v1/sessions/{session}", timeout=30)
    if response.status_code == 404:
        return None
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _bound_to(
    gw: RunningGateway, completion: str, headers: Mapping[str, str], expected: str, *others: str
) -> None:
    assert headers["x-session-id"] == expected
    session = _session(gw, expected)
    assert session is not None and [c["completion_id"] for c in session["calls"]] == [completion]
    for other in others:
        assert _session(gw, other) is None, f"nothing should be bound to {other}"


def test_path_beats_header_metadata_and_user(gw: RunningGateway) -> None:
    path, header, meta, user = _id("path"), _id("header"), _id("meta"), _id("user")
    completion, headers = _call(
        gw, path, headers={"X-Session-Id": header}, metadata={"session_id": meta}, user=user
    )
    _bound_to(gw, completion, headers, path, header, meta, user)


def test_header_beats_metadata_and_user(gw: RunningGateway) -> None:
    header, meta, user = _id("header"), _id("meta"), _id("user")
    completion, headers = _call(
        gw, headers={"X-Session-Id": header}, metadata={"session_id": meta}, user=user
    )
    _bound_to(gw, completion, headers, header, meta, user)


def test_metadata_beats_user(gw: RunningGateway) -> None:
    meta, user = _id("meta"), _id("user")
    completion, headers = _call(gw, metadata={"session_id": meta}, user=user)
    _bound_to(gw, completion, headers, meta, user)


def test_user_binds_when_nothing_else_does(gw: RunningGateway) -> None:
    user = _id("user")
    completion, headers = _call(gw, user=user)
    _bound_to(gw, completion, headers, user)
    second, _ = _call(gw, user=user)
    session = _session(gw, user)
    assert session is not None and [c["completion_id"] for c in session["calls"]] == [completion, second]


def test_unbound_call_is_a_one_call_session_named_after_its_completion(gw: RunningGateway) -> None:
    completion, headers = _call(gw)
    assert completion.startswith("chatcmpl-")
    _bound_to(gw, completion, headers, completion)
    session = _session(gw, completion)
    assert session is not None and session["id"] == completion
    other, _ = _call(gw)
    assert other != completion and len(_session(gw, completion)["calls"]) == 1  # type: ignore[index]
    reward = httpx.post(f"{gw.url}/v1/rewards", json={"session_id": completion, "reward": 1.0}, timeout=30)
    assert reward.status_code == 200 and reward.json()["session_id"] == completion


def test_response_headers_carry_policy_version_and_session(gw: RunningGateway) -> None:
    session = _id("hdr")
    _, headers = _call(gw, session)
    assert headers["x-policy-version"] == "0" and headers["x-session-id"] == session
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{gw.v1(session)}/chat/completions", json=body, timeout=30) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-policy-version"] == "0" and streamed.headers["x-session-id"] == session
        assert streamed.read().endswith(b"data: [DONE]\n\n")


def _group(gw: RunningGateway, session: str) -> str:
    stored = _session(gw, session)
    assert stored is not None
    groups = {c["group_id"] for c in stored["calls"]}
    assert groups == {stored["group_id"]}
    return stored["group_id"]  # type: ignore[no-any-return]


def test_group_from_path_then_header_then_metadata(gw: RunningGateway) -> None:
    on_path, by_header, by_meta = _id("s"), _id("s"), _id("s")
    _call(gw, on_path, "g-path", headers={"X-Group-Id": "g-header"}, metadata={"group_id": "g-meta"})
    _call(gw, headers={"X-Session-Id": by_header, "X-Group-Id": "g-header"}, metadata={"group_id": "g-meta"})
    _call(gw, by_meta, metadata={"group_id": "g-meta"})
    assert (_group(gw, on_path), _group(gw, by_header), _group(gw, by_meta)) == (
        "g-path",
        "g-header",
        "g-meta",
    )


def test_group_defaults_to_a_hash_of_the_first_prompt(gw: RunningGateway) -> None:
    system: ChatCompletionMessageParam = {"role": "system", "content": "Add numbers."}
    task: list[ChatCompletionMessageParam] = [system, {"role": "user", "content": "2 + 3?"}]
    other: list[ChatCompletionMessageParam] = [system, {"role": "user", "content": "4 + 5?"}]
    first, second, third = _id("try"), _id("try"), _id("try")
    _call(gw, first, messages=task)
    _call(gw, second, messages=task)
    _call(gw, third, messages=other)
    assert _group(gw, first) == _group(gw, second)
    assert _group(gw, first).startswith("p-")
    assert _group(gw, third) != _group(gw, first)
    unbound, _ = _call(gw, messages=task)  # a one-call session meets the others in the task's group
    assert _group(gw, unbound) == _group(gw, first)


def test_invalid_session_ids_are_refused(gw: RunningGateway) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    for headers in ({"X-Session-Id": "x" * 257}, {"X-Group-Id": "y" * 257}):
        response = httpx.post(f"{gw.v1()}/chat/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] in ("invalid_session_id", "invalid_group_id")
