"""The token chain over real HTTP with the OpenAI SDK: one trajectory per unedited conversation,
token for token what the engine was given and sampled; segments on edits; branches on forks."""

from __future__ import annotations

import json
from typing import Any

import httpx
from openai import OpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway
from tests.support.tool_model import ADD_TOOL, ANSWER, GREETING, QUESTION

MODEL = "tool-tiny"


def _trajectories(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory")
    response.raise_for_status()
    return response.json()["trajectories"]  # type: ignore[no-any-return]


def _calls(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}").json()["calls"]  # type: ignore[no-any-return]


def _engine(gw: RunningGateway) -> RecordingEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, RecordingEngine)
    return engine


def _assert_one_exact_segment(gw: RunningGateway, session: str, turns: int) -> dict[str, Any]:
    """The session is one segment whose tokens are the last prompt the engine saw plus its sample,
    each prompt extending the previous prompt + sample, with the loss mask exactly on sampled ids."""
    generations = _engine(gw).generations[-turns:]
    for before, after in zip(generations, generations[1:], strict=False):
        chain = before.prompt_ids + before.token_ids
        assert after.prompt_ids[: len(chain)] == chain
    (trajectory,) = _trajectories(gw, session)
    (segment,) = trajectory["segments"]
    last = generations[-1]
    assert segment["token_ids"] == last.prompt_ids + last.token_ids
    sampled = [0] * len(segment["token_ids"])
    logprobs = [0.0] * len(segment["token_ids"])
    for gen in generations:
        start = len(gen.prompt_ids)
        for i, lp in enumerate(gen.logprobs):
            sampled[start + i] = 1
            logprobs[start + i] = lp
    assert segment["loss_mask"] == sampled
    assert all(abs(a - b) < 1e-6 for a, b in zip(segment["logprobs"], logprobs, strict=True))
    return segment


def test_multi_turn_chat_is_one_token_exact_trajectory(tool_gateway: RunningGateway) -> None:
    client = OpenAI(base_url=tool_gateway.v1("chat-1"), api_key="unused")
    messages: list[Any] = [{"role": "user", "content": GREETING[0]}]
    for follow_up in ("Tell me more.", "Thanks!"):
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
    client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)

    assert [c["link"] for c in _calls(tool_gateway, "chat-1")] == ["start", "extend", "extend"]
    segment = _assert_one_exact_segment(tool_gateway, "chat-1", turns=3)
    assert segment["reason"] == "start" and len(segment["call_ids"]) == 3


def test_tool_call_conversation_is_one_trajectory(tool_gateway: RunningGateway) -> None:
    client = OpenAI(base_url=tool_gateway.v1("tools-1"), api_key="unused")
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD_TOOL], temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD_TOOL], temperature=0)
    assert second.choices[0].message.content == ANSWER

    assert [c["link"] for c in _calls(tool_gateway, "tools-1")] == ["start", "extend"]
    segment = _assert_one_exact_segment(tool_gateway, "tools-1", turns=2)
    text = _engine(tool_gateway).inner.tokenizer.decode(segment["token_ids"])  # type: ignore[attr-defined]
    assert "<tool_call>" in text and "<tool_response>\n5\n</tool_response>" in text


def test_edited_history_starts_a_new_segment_with_its_reason(tool_gateway: RunningGateway) -> None:
    client = OpenAI(base_url=tool_gateway.v1("edit-1"), api_key="unused")
    messages: list[Any] = [{"role": "user", "content": GREETING[0]}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    edited = {"role": "assistant", "content": (reply.choices[0].message.content or "") + " (edited)"}
    client.chat.completions.create(model=MODEL, messages=[*messages, edited, {"role": "user", "content": "Ok"}],
                                   temperature=0, max_tokens=4)

    (trajectory,) = _trajectories(tool_gateway, "edit-1")
    assert [s["reason"] for s in trajectory["segments"]] == ["start", "prefix_changed"]
    second = trajectory["segments"][1]
    assert second["token_ids"] == _engine(tool_gateway).generations[-1].prompt_ids + \
        _engine(tool_gateway).generations[-1].token_ids


def test_extending_an_older_call_forks_a_branch(tool_gateway: RunningGateway) -> None:
    client = OpenAI(base_url=tool_gateway.v1("fork-1"), api_key="unused")
    base: list[Any] = [{"role": "user", "content": GREETING[0]}]
    reply = client.chat.completions.create(model=MODEL, messages=base, temperature=0, max_tokens=8)
    history = [*base, reply.choices[0].message.model_dump(exclude_none=True)]
    for question in ("First branch?", "Second branch?"):
        client.chat.completions.create(model=MODEL, messages=[*history, {"role": "user", "content": question}],
                                       temperature=0, max_tokens=4)

    assert [c["link"] for c in _calls(tool_gateway, "fork-1")] == ["start", "extend", "branch"]
    trajectories = _trajectories(tool_gateway, "fork-1")
    assert len(trajectories) == 2
    first_call = _calls(tool_gateway, "fork-1")[0]["id"]
    for trajectory in trajectories:
        (segment,) = trajectory["segments"]
        assert segment["call_ids"][0] == first_call
    prefixes = {tuple(t["segments"][0]["token_ids"][:20]) for t in trajectories}
    assert len(prefixes) == 1


def test_chain_survives_a_gateway_restart(tool_gateway: RunningGateway, tmp_path: Any) -> None:
    """Chain state lives in the store: a new gateway on the same store extends the old calls."""
    from tests.support.servers import start_gateway

    client = OpenAI(base_url=tool_gateway.v1("restart-1"), api_key="unused")
    messages: list[Any] = [{"role": "user", "content": GREETING[0]}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again"}]
    engine = _engine(tool_gateway)
    db_url = str(tool_gateway.gateway.db.url)
    tool_gateway.stop()

    again = start_gateway(engine, tool_gateway.gateway.renderer.tokenizer.name_or_path, db_url)
    try:
        OpenAI(base_url=again.v1("restart-1"), api_key="unused").chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=4)
        assert [c["link"] for c in _calls(again, "restart-1")] == ["start", "extend"]
        _assert_one_exact_segment(again, "restart-1", turns=2)
    finally:
        again.stop()
