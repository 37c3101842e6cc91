"""Tool-call turns against a gateway over a scripted engine (tests/support/scripted.py), through each API's
real SDK: the model writes what a test needs on cue, and everything after it (parsing, response shapes,
chaining, storage) is the gateway's own. Shared by the tests of calls the parser cannot read whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
from openai import OpenAI
from transformers import AutoTokenizer

from tests.support.scripted import ScriptedEngine
from tests.support.servers import RunningGateway, start_gateway
from tests.support.tool_turns import ADD, LOOKUP, Turn, ask_chat, ask_messages, ask_responses

FORCED = {"chat": {"type": "function", "function": {"name": "lookup"}},
          "responses": {"type": "function", "name": "lookup"}, "messages": {"type": "tool", "name": "lookup"}}
APIS = ("chat", "responses", "messages")


def scripted_gateway(model_path: Path, database: Path) -> RunningGateway:
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(str(model_path)), "tiny")
    return start_gateway(engine, model_path, f"sqlite:///{database}")


def engine_of(gw: RunningGateway) -> ScriptedEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, ScriptedEngine)
    return engine


def token_count(gw: RunningGateway, text: str) -> int:
    """How many tokens `text` samples as: a max_tokens that cuts a reply right after it."""
    return len(engine_of(gw).tokenizer.encode(text, add_special_tokens=False))


def ask(gw: RunningGateway, api: str, session: str, conversation: list[dict[str, Any]], *, stream: bool = False,
        max_tokens: int = 64, forced: bool = False, tools: list[Any] | None = None, calls: int = 1) -> Turn:
    """One call with the lookup and add tools offered (`forced`: lookup's call forced); `calls`: how many
    the reply must make."""
    tools = tools or [LOOKUP, ADD]
    choice = FORCED[api] if forced else None
    if api == "messages":
        client = anthropic.Anthropic(base_url=f"{gw.url}/s/{session}", api_key="unused", max_retries=0)
        return ask_messages(client, "tiny", conversation, stream=stream, max_tokens=max_tokens, tools=tools,
                            tool_choice=choice, calls=calls)
    openai = OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=0)
    asker = ask_chat if api == "chat" else ask_responses
    return asker(openai, "tiny", conversation, stream=stream, max_tokens=max_tokens, tools=tools, tool_choice=choice,
                 calls=calls)


def ask_plain(gw: RunningGateway, api: str, session: str, conversation: list[dict[str, Any]], *,
              stream: bool = False) -> None:
    """A call whose reply is text (the same tools offered: they are part of the history), through the same SDK."""
    if api == "messages":
        client = anthropic.Anthropic(base_url=f"{gw.url}/s/{session}", api_key="unused", max_retries=0)
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in (LOOKUP, ADD)]
        if stream:
            with client.messages.stream(model="tiny", messages=conversation, tools=tools,  # type: ignore
                                        max_tokens=32) as events:
                assert events.get_final_message().stop_reason == "end_turn"
        else:
            assert client.messages.create(model="tiny", messages=conversation, tools=tools,  # type: ignore
                                          max_tokens=32).stop_reason == "end_turn"
        return
    openai = OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=0)
    if api == "chat":
        reply = openai.chat.completions.create(model="tiny", messages=conversation,  # type: ignore[arg-type]
                                               tools=[LOOKUP, ADD], max_tokens=32, stream=stream)
        finish = [c.choices[0].finish_reason for c in reply][-1] if stream else reply.choices[0].finish_reason  # type: ignore
        assert finish == "stop"
    else:
        response = openai.responses.create(model="tiny", input=conversation,  # type: ignore[arg-type]
                                           tools=[{"type": "function", **t["function"]} for t in (LOOKUP, ADD)],
                                           max_output_tokens=32,
                                           stream=stream)
        status = list(response)[-1].response.status if stream else response.status  # type: ignore
        assert status == "completed"


def assert_one_exact_segment(gw: RunningGateway, session: str, calls: int) -> None:
    """The session is one trajectory of one segment: the engine's last prompt and sample, token for token,
    with exactly the sampled tokens of every call in the loss."""
    engine = engine_of(gw)
    (trajectory,) = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory").json()["trajectories"]
    (segment,) = trajectory["segments"]
    assert len(segment["call_ids"]) == calls
    assert segment["token_ids"] == engine.prompts[-1] + engine.samples[-1]
    sampled = [0] * len(segment["token_ids"])
    for prompt, sample in zip(engine.prompts[-calls:], engine.samples[-calls:], strict=True):
        sampled[len(prompt):len(prompt) + len(sample)] = [1] * len(sample)
    assert segment["loss_mask"] == sampled
