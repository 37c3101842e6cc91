"""Sampling parameters the engines are not given, and `parallel_tool_calls`, over real HTTP and real SDKs.

The engines' `SamplingParams` (tracetrain/engines/base.py) has no penalties, logit bias or top-k, so the
gateway cannot pass them on: each is refused by name (400 `unsupported_parameter`, `param` set) unless it
has its neutral value, never silently ignored. `parallel_tool_calls: false` (Anthropic:
`disable_parallel_tool_use`) the gateway honours itself, as vLLM does: the reply holds the model's first
tool call only, while the record keeps every token it sampled and the conversation goes on extending it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tests.support.tool_model import overfit
from tracetrain.engines.transformers_engine import TransformersEngine

TINY = "tiny"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("param", "value"), [
    ("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("logit_bias", {"1234": -100}), ("top_k", 5),
])
def test_a_chat_parameter_the_engines_are_not_given_is_refused_by_name(gateway: RunningGateway, param: str,
                                                                       value: Any) -> None:
    client = OpenAI(base_url=gateway.v1("penalties"), api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=TINY, messages=HELLO, max_tokens=2,  # type: ignore[arg-type]
                                       extra_body={param: value})
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_parameter" and error["param"] == param
    assert param in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{gateway.url}/v1/sessions/penalties").status_code == 404, "nothing was recorded"


def test_neutral_values_are_accepted(gateway: RunningGateway) -> None:
    """The SDK's own defaults and explicit neutral values: 0, an empty map, -1 or 0 for top-k, null."""
    client = OpenAI(base_url=gateway.v1("neutral"), api_key="unused", max_retries=0)
    for extra in ({"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "top_k": -1},
                  {"frequency_penalty": None, "presence_penalty": None, "logit_bias": None, "top_k": 0}):
        reply = client.chat.completions.create(model=TINY, messages=HELLO, max_tokens=2,  # type: ignore[arg-type]
                                               extra_body=extra)
        assert reply.choices[0].finish_reason in ("length", "stop")
    completions = OpenAI(base_url=gateway.v1("neutral-cmpl"), api_key="unused", max_retries=0).completions
    completions.create(model=TINY, prompt="Once", max_tokens=2, frequency_penalty=0, presence_penalty=0,
                       logit_bias={})
    with pytest.raises(openai.BadRequestError) as refused:
        completions.create(model=TINY, prompt="Once", max_tokens=2, presence_penalty=0.3)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "presence_penalty"


def test_messages_top_k_is_refused_unless_neutral(gateway: RunningGateway) -> None:
    client = anthropic.Anthropic(base_url=f"{gateway.url}/s/top-k", api_key="unused", max_retries=0)
    hello: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as refused:  # the SDK (2.x) takes sampling parameters as extras
        client.messages.create(model=TINY, max_tokens=2, extra_body={"top_k": 5}, messages=hello)
    assert "top_k" in refused.value.message and "not supported" in refused.value.message
    reply = client.messages.create(model=TINY, max_tokens=2, extra_body={"top_k": 0}, messages=hello)
    assert reply.usage.output_tokens == 2


# --- parallel_tool_calls -------------------------------------------------------------------------------------

TWO_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "mul", "description": "Multiply two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
QUESTION = "What are 2 + 3 and 2 * 3? Use the tools."
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
             '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
MODEL = "two-calls"


def two_calls_model_dir(steps: int = 80) -> Path:
    """A tiny model overfit (as tests/support/tool_model.py's) to answer QUESTION with two tool calls at once."""
    from tracetrain.engines.models import cache_root, save_model_dir, tiny_model_dir
    from tracetrain.proxy.render import ChatRenderer

    target = cache_root() / f"tiny-two-calls-s{steps}-v1"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tiny_model_dir(hidden=128)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    prompt = ChatRenderer(tokenizer).render([{"role": "user", "content": QUESTION}], TWO_TOOLS, generation=True)
    reply = tokenizer.encode(TWO_CALLS, add_special_tokens=False) + tokenizer.encode("<|im_end|>",
                                                                                     add_special_tokens=False)
    overfit(model, [(prompt, reply)], steps=steps, what="two-calls model")
    return save_model_dir(target, model, tokenizer)


@pytest.fixture(scope="module")
def two_calls_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    pytest.importorskip("torch")
    path = two_calls_model_dir()
    engine = RecordingEngine(TransformersEngine(path, model_name=MODEL))
    running = start_gateway(engine, path, f"sqlite:///{tmp_path_factory.mktemp('two-calls') / 'gw.db'}")
    yield running
    running.stop()


def _chat(gw: RunningGateway, session: str, **extra: Any) -> Any:
    client = OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          tools=TWO_TOOLS, temperature=0, max_tokens=96, **extra)  # type: ignore[arg-type]


def test_the_model_calls_two_tools_at_once(two_calls_gateway: RunningGateway) -> None:
    for parallel in ({}, {"parallel_tool_calls": True}):
        calls = _chat(two_calls_gateway, f"parallel-{bool(parallel)}", **parallel).choices[0].message.tool_calls
        assert [c.function.name for c in calls or []] == ["add", "mul"]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_replies_with_the_first_call_only(two_calls_gateway: RunningGateway,
                                                                    stream: bool) -> None:
    session = f"one-call-{stream}"
    if stream:
        chunks = list(_chat(two_calls_gateway, session, parallel_tool_calls=False, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        names = [d.function.name for d in deltas if d.function and d.function.name]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["tool_calls"]
    else:
        reply = _chat(two_calls_gateway, session, parallel_tool_calls=False)
        names = [c.function.name for c in reply.choices[0].message.tool_calls or []]
        assert reply.choices[0].finish_reason == "tool_calls"
    assert names == ["add"]
    (call,) = httpx.get(f"{two_calls_gateway.url}/v1/sessions/{session}").json()["calls"]
    assert [c["function"]["name"] for c in call["response_message"]["tool_calls"]] == ["add"]
    engine = two_calls_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    sampled = two_calls_gateway.gateway.renderer.tokenizer.decode(engine.generations[-1].token_ids)
    assert sampled.count("<tool_call>") == 2, "the record keeps every token the model sampled"


def test_the_conversation_goes_on_from_the_one_call(two_calls_gateway: RunningGateway) -> None:
    """The client sends back the reply it got (one call) and its result: that extends the recorded call."""
    session = "one-call-chain"
    first = _chat(two_calls_gateway, session, parallel_tool_calls=False).choices[0].message
    (call,) = first.tool_calls or []
    client = OpenAI(base_url=two_calls_gateway.v1(session), api_key="unused", max_retries=0)
    client.chat.completions.create(model=MODEL, tools=TWO_TOOLS, temperature=0, max_tokens=4,  # type: ignore[arg-type]
                                   messages=[{"role": "user", "content": QUESTION},
                                             first.model_dump(exclude_none=True),
                                             {"role": "tool", "tool_call_id": call.id, "content": "5"}])
    calls = httpx.get(f"{two_calls_gateway.url}/v1/sessions/{session}").json()["calls"]
    assert [c["link"] for c in calls] == ["start", "extend"]


def test_anthropic_disable_parallel_tool_use_is_honoured(two_calls_gateway: RunningGateway) -> None:
    client = anthropic.Anthropic(base_url=f"{two_calls_gateway.url}/s/one-use", api_key="unused", max_retries=0)
    tools: Any = [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in TWO_TOOLS]
    ask = {"model": MODEL, "max_tokens": 96, "tools": tools, "extra_body": {"temperature": 0},
           "messages": [{"role": "user", "content": QUESTION}]}
    both = client.messages.create(**ask, tool_choice={"type": "auto"})
    assert [b.name for b in both.content if b.type == "tool_use"] == ["add", "mul"]
    one = client.messages.create(**ask, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.name for b in one.content if b.type == "tool_use"] == ["add"] and one.stop_reason == "tool_use"
    with client.messages.stream(**ask, tool_choice={"type": "auto", "disable_parallel_tool_use": True}) as events:
        streamed = events.get_final_message()
    assert [json.dumps(b.input) for b in streamed.content if b.type == "tool_use"] == ['{"a": 2, "b": 3}']
