"""The chat API behaves as OpenAI's does for the real SDK: streaming, tools, n, stop, limits, logprobs."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support.servers import RunningGateway
from tests.support.tool_model import ADD_TOOL, GREETING, QUESTION

MODEL = "tool-tiny"
HELLO = [{"role": "user", "content": GREETING[0]}]


def _client(gw: RunningGateway, session: str) -> OpenAI:
    return OpenAI(base_url=gw.v1(session), api_key="unused")


def _calls(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}").json()["calls"]  # type: ignore[no-any-return]


def test_streaming_yields_the_same_answer_as_a_plain_call(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway, "stream-1")
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content == GREETING[1]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3, "tokens arrive as they are made"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]
    assert len(_calls(tool_gateway, "stream-1")) == 2


def test_streamed_tool_calls_arrive_as_tool_call_deltas(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway, "stream-tools")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=[ADD_TOOL], temperature=0, stream=True))
    assert all("<tool_call" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments or "") == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert _calls(tool_gateway, "stream-tools")[0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_returns_text(tool_gateway: RunningGateway) -> None:
    reply = _client(tool_gateway, "tools-none").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=[ADD_TOOL], tool_choice="none",
        temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert "<tool_call>" in (reply.choices[0].message.content or "")


def test_n_choices_are_separate_calls_in_one_session(tool_gateway: RunningGateway) -> None:
    reply = _client(tool_gateway, "n-1").chat.completions.create(
        model=MODEL, messages=HELLO, n=3, temperature=1.0, seed=7, max_tokens=6)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    calls = _calls(tool_gateway, "n-1")
    assert sorted(c["choice_index"] for c in calls) == [0, 1, 2]
    assert {c["completion_id"] for c in calls} == {reply.id}
    assert reply.usage and reply.usage.completion_tokens == sum(c["completion_tokens"] for c in calls)


def test_stop_and_token_limits(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway, "limits-1")
    stopped = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, stop=["help"])
    assert stopped.choices[0].message.content == "Hello! How can I "
    assert stopped.choices[0].finish_reason == "stop"
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        short = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, **limit)  # type: ignore[arg-type]
        assert short.choices[0].finish_reason == "length"
        assert short.usage and short.usage.completion_tokens == 3


def test_logprobs_and_top_logprobs(tool_gateway: RunningGateway) -> None:
    reply = _client(tool_gateway, "lp-1").chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, logprobs=True, top_logprobs=3, max_tokens=5)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    stored = httpx.get(f"{tool_gateway.url}/v1/sessions/lp-1/trajectory").json()
    sampled = [lp for lp, m in zip(stored["trajectories"][0]["segments"][0]["logprobs"],
                                   stored["trajectories"][0]["segments"][0]["loss_mask"], strict=True) if m]
    for entry, recorded in zip(content, sampled, strict=True):
        assert entry.logprob == pytest.approx(recorded, abs=1e-5)
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


async def test_async_client_and_concurrent_sessions(tool_gateway: RunningGateway) -> None:
    import asyncio

    async def one(i: int) -> str:
        client = AsyncOpenAI(base_url=tool_gateway.v1(f"async-{i}"), api_key="unused")
        reply = await client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
        return reply.choices[0].message.content or ""

    answers = await asyncio.gather(*(one(i) for i in range(6)))
    assert answers == [GREETING[1]] * 6
    for i in range(6):
        assert len(_calls(tool_gateway, f"async-{i}")) == 1


def test_policy_version_is_on_every_response(tool_gateway: RunningGateway) -> None:
    raw = _client(tool_gateway, "ver-1").chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=2)
    assert raw.headers["x-policy-version"] == "0"
    assert _calls(tool_gateway, "ver-1")[0]["policy_version"] == 0
