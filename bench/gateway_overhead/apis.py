"""The three agent APIs the load generator speaks: request bodies and reply parsing per API.

One conversation (a system prompt, then alternating user and assistant texts) is sent in each API's own
shape, so that the gateway does the same work behind every one of them (same prompt tokens, same
answer) and only the protocol layer differs:

- `chat`: OpenAI Chat Completions, the system prompt as the first message;
- `responses`: OpenAI Responses, the system prompt as `instructions`, the turns as `input` items;
- `messages`: Anthropic Messages, the system prompt as `system`.

Each parser returns (response id, answer text, completion tokens) or raises `HTTPFailure`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.gateway_overhead.client import HTTPFailure, Reply

Turn = tuple[str, str]
"""(role, text): role is `user` or `assistant`."""
Parsed = tuple[str, str, int]


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    """Under `/s/<session>` on the gateway (and as is on an upstream that serves it)."""
    body: Callable[[str, list[Turn], int, bool, float | None], dict[str, Any]]
    parse: Callable[[Reply, bool], Parsed]


def _chat_body(system: str, turns: list[Turn], max_tokens: int, stream: bool, temp: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "",
        "messages": [{"role": "system", "content": system}, *({"role": r, "content": t} for r, t in turns)],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return _with_temperature(body, temp)


def _responses_body(
    system: str, turns: list[Turn], max_tokens: int, stream: bool, temp: float | None
) -> dict[str, Any]:
    items = [{"role": r, "content": t} for r, t in turns]
    body = {"model": "", "instructions": system, "input": items, "max_output_tokens": max_tokens, "stream": stream}
    return _with_temperature(body, temp)


def _messages_body(
    system: str, turns: list[Turn], max_tokens: int, stream: bool, temp: float | None
) -> dict[str, Any]:
    body = {"model": "", "system": system, "messages": [{"role": r, "content": t} for r, t in turns],
            "max_tokens": max_tokens, "stream": stream}
    return _with_temperature(body, temp)


def _with_temperature(body: dict[str, Any], temp: float | None) -> dict[str, Any]:
    if temp is not None:
        body["temperature"] = temp
    return body


def _stream_errors(reply: Reply) -> None:
    if not reply.events:
        raise HTTPFailure("stream ended without events")
    for event in reply.events:
        if "error" in event or event.get("type") == "error":
            raise HTTPFailure(f"error event: {event.get('error') or event}")


def _parse_chat(reply: Reply, stream: bool) -> Parsed:
    if not stream:
        data = reply.json()
        message = data["choices"][0]["message"]
        return data["id"], message["content"] or "", int(data["usage"]["completion_tokens"])
    if not reply.done:
        raise HTTPFailure("stream ended without [DONE]")
    _stream_errors(reply)
    choices = [c for e in reply.events for c in e.get("choices") or ()]
    text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    usage: dict[str, Any] = next((e["usage"] for e in reversed(reply.events) if e.get("usage")), {})
    return reply.events[0]["id"], text, int(usage.get("completion_tokens") or 0)


def _response_text(response: dict[str, Any]) -> str:
    return "".join(part.get("text") or "" for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def _parse_responses(reply: Reply, stream: bool) -> Parsed:
    if not stream:
        data = reply.json()
        return data["id"], _response_text(data), int(data["usage"]["output_tokens"])
    _stream_errors(reply)
    last = reply.events[-1]
    if last.get("type") not in ("response.completed", "response.incomplete"):
        raise HTTPFailure(f"stream ended with {last.get('type')}, not response.completed")
    response = last["response"]
    return response["id"], _response_text(response), int(response["usage"]["output_tokens"])


def _parse_messages(reply: Reply, stream: bool) -> Parsed:
    if not stream:
        data = reply.json()
        text = "".join(block.get("text") or "" for block in data["content"])
        return data["id"], text, int(data["usage"]["output_tokens"])
    _stream_errors(reply)
    if reply.events[-1].get("type") != "message_stop":
        raise HTTPFailure(f"stream ended with {reply.events[-1].get('type')}, not message_stop")
    text = "".join((e["delta"].get("text") or "") for e in reply.events if e.get("type") == "content_block_delta")
    delta = next(e for e in reversed(reply.events) if e.get("type") == "message_delta")
    return reply.events[0]["message"]["id"], text, int(delta["usage"]["output_tokens"])


APIS: dict[str, Api] = {
    "chat": Api("chat", "/v1/chat/completions", _chat_body, _parse_chat),
    "responses": Api("responses", "/v1/responses", _responses_body, _parse_responses),
    "messages": Api("messages", "/v1/messages", _messages_body, _parse_messages),
}
