"""Bad input sent into a session that already has calls, in each API: a 4xx in that API's error
shape (400, or 404 for an unknown `previous_response_id`), and the session's recorded calls are
untouched and still extend as before. Also: a reward addressed by a Responses or Messages id lands
on that call, as one by a chat completion id does."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.servers import RunningGateway
from tests.support.tool_model import GREETING

MODEL = "tool-tiny"
FIRST = {"chat": {"messages": [{"role": "user", "content": GREETING[0]}], "max_tokens": 12, "temperature": 0},
         "responses": {"input": GREETING[0], "max_output_tokens": 12, "temperature": 0},
         "messages": {"messages": [{"role": "user", "content": GREETING[0]}], "max_tokens": 12, "temperature": 0}}
PATHS = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}
BAD: dict[str, list[dict[str, Any]]] = {
    "chat": [
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user", "content": GREETING[0]},
                      {"role": "tool", "tool_call_id": "call_nope", "content": "5"}]},
        {"messages": [{"role": "user", "content": [{"type": "nonsense"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
    ],
    "responses": [
        {"input": "more", "previous_response_id": "resp_nope"},
        {"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "5"}]},
        {"input": [{"type": "function_call", "name": "add"}]},  # no call_id, no arguments
        {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
    ],
    "messages": [
        {"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "5"}]}]},
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        {"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]},
        {"max_tokens": 8, "messages": "hi"},
    ],
}


def _post(gw: RunningGateway, session: str, api: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gw.url}/s/{session}/v1/{PATHS[api]}", json={"model": MODEL, **body},
                      headers={"anthropic-version": "2023-06-01"}, timeout=60)


def _calls(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}", timeout=30).json()["calls"]  # type: ignore[no-any-return]


def _error_message(api: str, response: httpx.Response) -> str:
    body = response.json()
    expected = "not_found_error" if response.status_code == 404 else "invalid_request_error"
    if api == "messages":
        assert body["type"] == "error", body
    assert body["error"]["type"] == expected, body
    return str(body["error"]["message"])


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_bad_input_into_a_recorded_session_loses_nothing(tool_gateway: RunningGateway, api: str) -> None:
    session = f"keep-{api}"
    first = _post(tool_gateway, session, api, FIRST[api])
    assert first.status_code == 200, first.text
    before = _calls(tool_gateway, session)
    assert len(before) == 1

    for bad in BAD[api]:
        response = _post(tool_gateway, session, api, bad)
        expected = 404 if "previous_response_id" in bad else 400
        assert response.status_code == expected, (bad, response.text)
        assert _error_message(api, response), bad

    assert _calls(tool_gateway, session) == before, "the recorded call is untouched"
    reply = first.json()
    if api == "responses":
        again = _post(tool_gateway, session, api, {"input": "And then?", "previous_response_id": reply["id"],
                                                   "max_output_tokens": 8})
    else:
        text = reply["choices"][0]["message"]["content"] if api == "chat" else reply["content"][0]["text"]
        history = [{"role": "user", "content": GREETING[0]}, {"role": "assistant", "content": text},
                   {"role": "user", "content": "And then?"}]
        again = _post(tool_gateway, session, api, {**FIRST[api], "messages": history})
    assert again.status_code == 200, again.text
    assert [c["link"] for c in _calls(tool_gateway, session)] == ["start", "extend"]


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_rewards_by_response_and_message_id(tool_gateway: RunningGateway, api: str) -> None:
    session = f"reward-{api}"
    reply = _post(tool_gateway, session, api, FIRST[api]).json()
    posted = httpx.post(f"{tool_gateway.url}/v1/rewards", json={"completion_id": reply["id"], "reward": 0.5,
                                                                "final": True}, timeout=30)
    assert posted.status_code == 200, posted.text
    info = httpx.get(f"{tool_gateway.url}/v1/sessions/{session}", timeout=30).json()
    (reward,) = info["rewards"]
    assert reward["call_id"] == f"{reply['id']}-0" and reward["value"] == 0.5 and info["status"] == "final"
