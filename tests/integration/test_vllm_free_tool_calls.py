"""A free tool call (tool_choice auto) cut short by max_tokens, through a real vLLM and the real SDKs: each API
answers in its own shape, never with the template's `<tool_call>` markup as text, and the reply sent back extends
the same trajectory. Forced calls: test_vllm_constraints.py; every shape and echo: test_cut_tool_calls.py.

SmolLM2-135M rarely calls a tool on its own; after two earlier calls in the conversation it imitates them,
greedily. The token limit cuts its call inside the item's name. The agent sends the reply back as its SDK gives
it, with the tool's result, and the two calls must be one segment whose loss mask is 1 exactly on the sampled
tokens.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine, assert_one_exact_segment
from tests.support.servers import RunningGateway

pytestmark = pytest.mark.vllm

LOOKUP: Any = {"name": "lookup", "description": "Look an item up in the catalogue.",
               "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}
ITEM = "Blue Chair 7 with the oak legs"
EARLIER = [("call_1", "Red Lamp 42"), ("call_2", "Green Desk 3")]
TOKENS = 24
"""Cuts inside the item's name (after the `<tool_call>` opener, `{"name": "lookup", "arguments": {"item": "`).
Measured on this prompt; `_check_arguments` says so if the model changes."""
STREAMS = [False, True]


def _chat_history() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for call_id, item in EARLIER:
        messages += [{"role": "user", "content": f"Look up {item}."},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": call_id, "type": "function",
                         "function": {"name": "lookup", "arguments": json.dumps({"item": item})}}]}]
    return [*messages, {"role": "user", "content": f"Look up {ITEM}."}]


def _check_arguments(arguments: str) -> None:
    """Arguments as the model wrote them before the cut: the start of the JSON object, not the whole."""
    assert arguments.startswith('{"item": "Blue'), arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


def _check_one_trajectory(gw: RunningGateway, session: str) -> None:
    (trajectory,) = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory", timeout=30).json()["trajectories"]
    engine = gw.gateway.engine
    assert isinstance(engine, RecordingEngine)
    assert_one_exact_segment(trajectory, engine.generations[-2:])


def _model(gw: RunningGateway) -> str:
    return gw.gateway.config.engine.served_model_name


@pytest.mark.parametrize("stream", STREAMS)
def test_chat_completions_returns_the_cut_call_and_chains_on(vllm_gateway: RunningGateway, stream: bool) -> None:
    session = f"free-chat-{stream}"
    client = OpenAI(base_url=vllm_gateway.v1(session), api_key="unused", timeout=120)
    asked: Any = {"model": _model(vllm_gateway), "messages": _chat_history(), "temperature": 0,
                  "max_tokens": TOKENS, "tools": [{"type": "function", "function": LOOKUP}]}
    if stream:
        chunks = [c for c in client.chat.completions.create(**asked, stream=True) if c.choices]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # no markup as text
        last = chunks[-1].choices[0]
        (delta_call,) = last.delta.tool_calls or []
        assert last.finish_reason == "length" and delta_call.function is not None
        call_id, name, arguments = delta_call.id, delta_call.function.name, delta_call.function.arguments or ""
        reply: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}
    else:
        first = client.chat.completions.create(**asked)
        message = first.choices[0].message
        (call,) = message.tool_calls or []
        assert first.choices[0].finish_reason == "length" and message.content is None
        assert call.type == "function"
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
        reply = message.model_dump(exclude_none=True)  # as the SDK gives it
    assert name == "lookup"
    _check_arguments(arguments)

    client.chat.completions.create(
        model=_model(vllm_gateway), temperature=0, max_tokens=8, tools=[{"type": "function", "function": LOOKUP}],
        messages=[*_chat_history(), reply, {"role": "tool", "tool_call_id": call_id, "content": "not found"}])
    _check_one_trajectory(vllm_gateway, session)


@pytest.mark.parametrize("stream", STREAMS)
def test_responses_returns_an_incomplete_function_call_and_chains_on(vllm_gateway: RunningGateway,
                                                                     stream: bool) -> None:
    session = f"free-responses-{stream}"
    client = OpenAI(base_url=vllm_gateway.v1(session), api_key="unused", timeout=120)
    history: list[Any] = []
    for call_id, item in EARLIER:
        history += [{"role": "user", "content": f"Look up {item}."},
                    {"type": "function_call", "call_id": call_id, "name": "lookup",
                     "arguments": json.dumps({"item": item})}]
    history.append({"role": "user", "content": f"Look up {ITEM}."})
    asked: Any = {"model": _model(vllm_gateway), "input": history, "temperature": 0,
                  "max_output_tokens": TOKENS, "tools": [{"type": "function", **LOOKUP}]}
    if stream:
        events = list(client.responses.create(**asked, stream=True))
        assert not [e for e in events if e.type == "response.output_text.delta"]  # no markup as text
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        response = client.responses.create(**asked)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (call,) = response.output
    assert call.type == "function_call" and call.status == "incomplete" and call.name == "lookup"
    _check_arguments(call.arguments)

    # Sent back as the SDK gives the items (the call with its status), then the tool's output.
    client.responses.create(model=_model(vllm_gateway), temperature=0, max_output_tokens=8,
                            tools=[{"type": "function", **LOOKUP}],
                            input=[*history, *response.output,
                                   {"type": "function_call_output", "call_id": call.call_id, "output": "not found"}])
    _check_one_trajectory(vllm_gateway, session)


@pytest.mark.parametrize("stream", STREAMS)
def test_messages_returns_a_tool_use_block_at_max_tokens_and_chains_on(vllm_gateway: RunningGateway,
                                                                       stream: bool) -> None:
    session = f"free-messages-{stream}"
    client = anthropic.Anthropic(base_url=f"{vllm_gateway.url}/s/{session}", api_key="unused")
    messages: list[Any] = []
    for call_id, item in EARLIER:
        messages += [{"role": "user", "content": f"Look up {item}."},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "lookup",
                                                        "input": {"item": item}}]}]
    messages.append({"role": "user", "content": f"Look up {ITEM}."})
    tools: Any = [{"name": LOOKUP["name"], "description": LOOKUP["description"], "input_schema": LOOKUP["parameters"]}]
    asked: Any = {"model": _model(vllm_gateway), "messages": messages, "max_tokens": TOKENS, "tools": tools,
                  "extra_body": {"temperature": 0}}
    if stream:
        with client.messages.stream(**asked) as events:
            final = events.get_final_message()
    else:
        final = client.messages.create(**asked)
    assert final.stop_reason == "max_tokens"
    (use,) = final.content  # no text block: no markup as text
    assert use.type == "tool_use" and use.name == "lookup"
    # The input is what was written, read as far as it goes: the item's name so far.
    assert set(use.input) == {"item"} and ITEM.startswith(use.input["item"]) and use.input["item"].startswith("Blue")

    client.messages.create(model=_model(vllm_gateway), max_tokens=8, tools=tools, extra_body={"temperature": 0},
                           messages=[*messages, {"role": "assistant", "content": final.content},
                                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                   "content": "not found"}]}])
    _check_one_trajectory(vllm_gateway, session)
