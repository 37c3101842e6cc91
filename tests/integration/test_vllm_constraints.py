"""tool_choice and response_format through a real vLLM: enforced by constrained decoding, recorded exactly.

SmolLM2-135M rarely calls a tool on its own and, left free, writes arguments that miss the schema;
these tests show the gateway makes a forced call well-formed whatever the sample (several seeds).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway
from tests.support.tool_turns import ADD as TOOL_ADD
from tests.support.tool_turns import LOOKUP as TOOL_LOOKUP
from tests.support.tool_turns import QUESTION as QUESTION_CUT
from tests.support.tool_turns import ask_chat, ask_messages, ask_responses, tool_result

pytestmark = pytest.mark.vllm

ADD: Any = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
LOOKUP: Any = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
QUESTION: Any = [{"role": "user", "content": "What is 17 plus 25?"}]


def _client(gw: RunningGateway, session: str) -> OpenAI:
    return OpenAI(base_url=gw.v1(session), api_key="unused", timeout=120)


def _trajectory(gw: RunningGateway, session: str) -> dict[str, Any]:
    (trajectory,) = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory", timeout=30).json()["trajectories"]
    return trajectory


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_tool_choice_yields_a_schema_valid_call_and_chains_on(vllm_gateway: RunningGateway, seed: int) -> None:
    session = f"forced-{seed}"
    client = _client(vllm_gateway, session)
    model = vllm_gateway.gateway.config.engine.served_model_name
    first = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[ADD, LOOKUP], temperature=1.0, seed=seed, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls" and call.type == "function"
    assert call.function.name == "add"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"a", "b"} and all(isinstance(v, int) for v in arguments.values())

    history: list[Any] = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": str(sum(arguments.values()))}]
    second = client.chat.completions.create(model=model, messages=history, tools=[ADD, LOOKUP],
                                            temperature=1.0, seed=seed, max_tokens=16)

    engine = vllm_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    forced, free = engine.generations[-2:]
    tokenizer = vllm_gateway.gateway.renderer.tokenizer
    assert tokenizer.decode(forced.prompt_ids).endswith("<|im_start|>assistant\n<tool_call>\n")
    (segment,) = _trajectory(vllm_gateway, session)["segments"]
    assert segment["reason"] == "start" and len(segment["call_ids"]) == 2
    assert segment["token_ids"] == free.prompt_ids + free.token_ids
    assert free.prompt_ids[: len(forced.prompt_ids) + len(forced.token_ids)] == forced.prompt_ids + forced.token_ids
    # The forced opener is prompt (mask 0); only what the model sampled is trained on.
    mask = segment["loss_mask"]
    assert sum(mask) == len(forced.token_ids) + len(free.token_ids)
    assert mask[len(forced.prompt_ids) - 1] == 0 and mask[len(forced.prompt_ids)] == 1
    assert second.choices[0].message.content is not None or second.choices[0].message.tool_calls


def test_required_tool_choice_picks_one_of_the_tools_when_streaming(vllm_gateway: RunningGateway) -> None:
    client = _client(vllm_gateway, "forced-stream")
    stream = client.chat.completions.create(
        model=vllm_gateway.gateway.config.engine.served_model_name, messages=QUESTION, tools=[ADD, LOOKUP],
        tool_choice="required", temperature=1.0, seed=7, max_tokens=48, stream=True)
    chunks = [c for c in stream if c.choices]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # the JSON is not leaked as text
    (call,) = chunks[-1].choices[0].delta.tool_calls or []
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and call.function is not None
    assert call.function.name in ("add", "lookup")
    json.loads(call.function.arguments or "")


def test_response_format_json_schema_is_enforced(vllm_gateway: RunningGateway) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    reply = _client(vllm_gateway, "json-schema").chat.completions.create(
        model=vllm_gateway.gateway.config.engine.served_model_name, messages=QUESTION, temperature=1.0, seed=3,
        max_tokens=32, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    parsed = json.loads(reply.choices[0].message.content or "")
    assert set(parsed) == {"answer"} and isinstance(parsed["answer"], int)


def test_the_responses_and_messages_apis_enforce_forced_calls_and_schemas_too(vllm_gateway: RunningGateway) -> None:
    model = vllm_gateway.gateway.config.engine.served_model_name
    add = ADD["function"]
    responses = _client(vllm_gateway, "forced-responses").responses
    named = responses.create(model=model, input=QUESTION[0]["content"], temperature=1.0, max_output_tokens=48,
                             tools=[{"type": "function", **add}], tool_choice={"type": "function", "name": "add"})
    (call,) = [item for item in named.output if item.type == "function_call"]
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    formatted = responses.create(model=model, input=QUESTION[0]["content"], temperature=1.0, max_output_tokens=32,
                                 text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert isinstance(json.loads(formatted.output_text)["answer"], int)

    messages = anthropic.Anthropic(base_url=f"{vllm_gateway.url}/s/forced-messages", api_key="unused")
    with messages.messages.stream(model=model, max_tokens=48, messages=QUESTION, tool_choice={"type": "any"},
                                  tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                         for t in (ADD, LOOKUP)]) as stream:
        final = stream.get_final_message()
    (use,) = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name in ("add", "lookup")
    assert set(use.input) == ({"a", "b"} if use.name == "add" else {"word"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_forced_call_cut_by_max_tokens_is_a_call_and_the_session_stays_one_segment(
        vllm_gateway: RunningGateway, api: str, stream: bool) -> None:
    """Through each API's SDK: the cut call in the API's shape (no markup as text), then the agent sends it back
    with an error as its result, and the two calls are one segment with exactly the sampled tokens in the loss."""
    session, model = f"cut-{api}-{stream}", vllm_gateway.gateway.config.engine.served_model_name
    conversation: list[dict[str, Any]] = [{"role": "user", "content": QUESTION_CUT}]
    openai = _client(vllm_gateway, session)
    claude = anthropic.Anthropic(base_url=f"{vllm_gateway.url}/s/{session}", api_key="unused")
    ask = {"chat": lambda c, **kw: ask_chat(openai, model, c, **kw),
           "responses": lambda c, **kw: ask_responses(openai, model, c, **kw),
           "messages": lambda c, **kw: ask_messages(claude, model, c, **kw)}[api]
    forced = {"chat": {"type": "function", "function": {"name": "lookup"}},
              "responses": {"type": "function", "name": "lookup"}, "messages": {"type": "tool", "name": "lookup"}}[api]
    first = ask(conversation, stream=stream, max_tokens=10, tools=[TOOL_LOOKUP, TOOL_ADD], tool_choice=forced)
    assert first.name == "lookup" and not first.content
    if api == "messages":
        assert first.stop == "max_tokens" and isinstance(first.arguments, dict)
    else:
        assert first.stop == ("length" if api == "chat" else "incomplete")
        with pytest.raises(json.JSONDecodeError):
            json.loads(first.arguments)
    if api == "responses":
        assert first.call_status == "incomplete" and first.incomplete == {"reason": "max_output_tokens"}

    conversation += first.echo + tool_result(api, first, "error: cut short, call again")
    if api == "chat":
        openai.chat.completions.create(model=model, messages=conversation, tools=[TOOL_LOOKUP, TOOL_ADD],  # type: ignore
                                       max_tokens=4)
    elif api == "responses":
        openai.responses.create(model=model, input=conversation, max_output_tokens=4,  # type: ignore[arg-type]
                                tools=[{"type": "function", **t["function"]} for t in (TOOL_LOOKUP, TOOL_ADD)])
    else:
        claude.messages.create(model=model, messages=conversation, max_tokens=4,  # type: ignore[arg-type]
                               tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                                       "input_schema": t["function"]["parameters"]} for t in (TOOL_LOOKUP, TOOL_ADD)])

    engine = vllm_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    cut, after = engine.generations[-2:]
    (segment,) = _trajectory(vllm_gateway, session)["segments"]
    assert len(segment["call_ids"]) == 2 and segment["token_ids"] == after.prompt_ids + after.token_ids
    assert after.prompt_ids[: len(cut.prompt_ids) + len(cut.token_ids)] == cut.prompt_ids + cut.token_ids
    mask = segment["loss_mask"]
    assert sum(mask) == len(cut.token_ids) + len(after.token_ids)
    assert sum(mask[len(cut.prompt_ids): len(cut.prompt_ids) + len(cut.token_ids)]) == len(cut.token_ids)
