"""A tool call cut short by max_tokens, and other calls the parser cannot read whole, through each API's real
SDK, streamed and not: each comes back as a call in the API's own shape, never as template markup, and
whatever the agent sends back (the call as given, repaired, dropped, then a tool result) extends the same
trajectory, with the sampled tokens, and only those, in the loss.

A scripted engine writes the replies (tests/support/scripted.py): it is how a free call, or a broken one,
happens on cue. Forced calls through a real vLLM are in test_vllm_constraints.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.support.scripted import ScriptedEngine
from tests.support.servers import RunningGateway, start_gateway
from tests.support.tool_turns import (
    ADD,
    LOOKUP,
    QUESTION,
    Turn,
    ask_chat,
    ask_messages,
    ask_responses,
    tool_result,
    with_arguments,
)

CALL_JSON = '{"name": "lookup", "arguments": {"item": "[Item-1153] the blue one, with its full description"}}'
CUT_AFTER = '{"name": "lookup", "arguments": {"item": "[Item-11'
"""Where max_tokens cuts the call: inside its string argument."""
FORCED = {"chat": {"type": "function", "function": {"name": "lookup"}},
          "responses": {"type": "function", "name": "lookup"}, "messages": {"type": "tool", "name": "lookup"}}
APIS = ("chat", "responses", "messages")


@pytest.fixture
def scripted(tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(str(tiny_model_path)), "tiny")
    running = start_gateway(engine, tiny_model_path, f"sqlite:///{tmp_path / 'cut.db'}")
    yield running
    running.stop()


def _engine(gw: RunningGateway) -> ScriptedEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, ScriptedEngine)
    return engine


def _tokens(gw: RunningGateway, text: str) -> int:
    return len(_engine(gw).tokenizer.encode(text, add_special_tokens=False))


def ask(gw: RunningGateway, api: str, session: str, conversation: list[dict[str, Any]], *, stream: bool = False,
        max_tokens: int = 64, forced: bool = False, tools: list[Any] | None = None) -> Turn:
    tools = tools or [LOOKUP, ADD]
    choice = FORCED[api] if forced else None
    if api == "messages":
        client = anthropic.Anthropic(base_url=f"{gw.url}/s/{session}", api_key="unused", max_retries=0)
        return ask_messages(client, "tiny", conversation, stream=stream, max_tokens=max_tokens, tools=tools,
                            tool_choice=choice)
    openai = OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=0)
    asker = ask_chat if api == "chat" else ask_responses
    return asker(openai, "tiny", conversation, stream=stream, max_tokens=max_tokens, tools=tools, tool_choice=choice)


def _question(api: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}]  # the same shape in the three APIs


def assert_one_exact_segment(gw: RunningGateway, session: str, calls: int) -> None:
    """The session is one trajectory of one segment: the engine's last prompt and sample, token for token,
    with exactly the sampled tokens of every call in the loss."""
    engine = _engine(gw)
    (trajectory,) = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory").json()["trajectories"]
    (segment,) = trajectory["segments"]
    assert len(segment["call_ids"]) == calls
    assert segment["token_ids"] == engine.prompts[-1] + engine.samples[-1]
    sampled = [0] * len(segment["token_ids"])
    for prompt, sample in zip(engine.prompts[-calls:], engine.samples[-calls:], strict=True):
        sampled[len(prompt):len(prompt) + len(sample)] = [1] * len(sample)
    assert segment["loss_mask"] == sampled


def assert_cut_call(api: str, turn: Turn, content: str) -> None:
    """The shape each API gives a call cut by the token limit."""
    assert turn.name == "lookup" and turn.content == content and "<tool_call>" not in turn.content
    if api == "messages":
        # `input` must be an object: the members generated so far, a string cut short as far as it went.
        assert turn.stop == "max_tokens" and turn.arguments == {"item": "[Item-11"}
        return
    assert turn.arguments == CUT_AFTER.removeprefix('{"name": "lookup", "arguments": ')  # as generated
    if api == "chat":
        assert turn.stop == "length"
    else:
        assert turn.stop == "incomplete" and turn.call_status == "incomplete"
        assert turn.incomplete == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("forced", [False, True], ids=["free", "forced"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_cut_call_is_a_call_in_the_apis_shape_and_its_echo_extends_the_trajectory(
        scripted: RunningGateway, api: str, stream: bool, forced: bool) -> None:
    engine = _engine(scripted)
    text = CALL_JSON if forced else "Looking.\n<tool_call>\n" + CALL_JSON + "\n</tool_call>"
    written = CUT_AFTER if forced else "Looking.\n<tool_call>\n" + CUT_AFTER
    engine.replies += [text, "It is blue."]
    conversation = _question(api)
    first = ask(scripted, api, "s", conversation, stream=stream, forced=forced,
                max_tokens=_tokens(scripted, written))
    assert_cut_call(api, first, "" if forced else "Looking.")

    conversation += first.echo + tool_result(api, first, "error: the call was cut short")
    ask_plain(scripted, api, "s", conversation, stream=stream)
    assert_one_exact_segment(scripted, "s", 2)


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


REPAIRED = {"item": "[Item-11]"}


@pytest.mark.parametrize("variant", ["repaired", "dropped", "empty"])
@pytest.mark.parametrize("api", APIS)
def test_every_echo_of_a_cut_call_extends_the_same_segment(scripted: RunningGateway, api: str, variant: str) -> None:
    """The agent repairs the arguments, or drops them, then on the next turn sends them as first given: the
    three calls are one segment all the same."""
    engine = _engine(scripted)
    engine.replies += ["<tool_call>\n" + CALL_JSON, "Let me retry.", "Fine."]
    conversation = _question(api)
    first = ask(scripted, api, "v", conversation, max_tokens=_tokens(scripted, "<tool_call>\n" + CUT_AFTER))
    replaced: Any = {"repaired": REPAIRED, "dropped": {}, "empty": {}}[variant]
    if api != "messages":
        replaced = "" if variant == "empty" else json.dumps(replaced)
    result = tool_result(api, first, "error: the call was cut short")
    ask_plain(scripted, api, "v", [*conversation, *with_arguments(api, first.echo, replaced), *result])
    again = [{"role": "user", "content": "Go on."}]
    second = {"role": "assistant", "content": "Let me retry."}
    ask_plain(scripted, api, "v", [*conversation, *first.echo, *result, second, *again])
    assert_one_exact_segment(scripted, "v", 3)
    links = [c["link"] for c in httpx.get(f"{scripted.url}/v1/sessions/v").json()["calls"]]
    assert links == ["start", "extend", "extend"]


def test_a_cut_call_followed_by_a_user_message_extends_the_segment(scripted: RunningGateway) -> None:
    engine = _engine(scripted)
    engine.replies += ["<tool_call>\n" + CALL_JSON, "Sure."]
    first = ask(scripted, "chat", "u", _question("chat"), max_tokens=_tokens(scripted, "<tool_call>\n" + CUT_AFTER))
    ask_plain(scripted, "chat", "u", [*_question("chat"), *first.echo, {"role": "user", "content": "Shorter."}])
    assert_one_exact_segment(scripted, "u", 2)


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_whole_call_whose_arguments_are_not_json_is_a_call_with_them_as_written(
        scripted: RunningGateway, api: str) -> None:
    engine = _engine(scripted)
    engine.replies += ['<tool_call>\n{"name": "lookup", "arguments": {"item": "blue",}}\n</tool_call>', "Ok."]
    first = ask(scripted, api, "raw", _question(api))
    assert first.name == "lookup"
    if api == "messages":
        assert first.stop == "tool_use" and first.arguments == {"item": "blue"}  # what of them can be read
    else:
        assert first.stop == "tool_calls" and first.arguments == '{"item": "blue",}'
    repaired: Any = {"item": "blue"} if api == "messages" else '{"item": "blue"}'
    echo = with_arguments(api, first.echo, repaired)
    ask_plain(scripted, api, "raw", [*_question(api), *echo, *tool_result(api, first, "blue: found")])
    assert_one_exact_segment(scripted, "raw", 2)


def test_a_call_to_a_tool_not_offered_is_a_call_by_that_name(scripted: RunningGateway) -> None:
    """As OpenAI and vLLM answer it: the agent decides (most answer with an error as the tool's result)."""
    engine = _engine(scripted)
    engine.replies.append('<tool_call>\n{"name": "fetch", "arguments": {"url": "x"}}\n</tool_call>')
    turn = ask(scripted, "chat", "unknown", _question("chat"))
    assert (turn.stop, turn.name, json.loads(turn.arguments)) == ("tool_calls", "fetch", {"url": "x"})


@pytest.mark.parametrize(("written", "content", "finish"), [
    # A block that names no tool is not a call: the model's text, verbatim.
    ("<tool_call>\nno idea\n</tool_call>", "<tool_call>\nno idea\n</tool_call>", "stop"),
    # A call the model ended its turn in without the closing tag is whole.
    ('<tool_call>\n{"name": "lookup", "arguments": {"item": "x"}}', None, "tool_calls"),
])
def test_blocks_that_are_not_quite_calls(scripted: RunningGateway, written: str, content: str | None,
                                         finish: str) -> None:
    _engine(scripted).replies.append(written)
    reply = OpenAI(base_url=scripted.v1("b"), api_key="unused").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[LOOKUP])
    assert reply.choices[0].message.content == content and reply.choices[0].finish_reason == finish
