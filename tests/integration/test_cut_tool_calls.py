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

import httpx
import pytest
from openai import OpenAI

from tests.support.scripted_tools import (
    APIS,
    ask,
    ask_plain,
    assert_one_exact_segment,
    engine_of,
    scripted_gateway,
    token_count,
)
from tests.support.servers import RunningGateway
from tests.support.tool_turns import LOOKUP, QUESTION, Turn, tool_result, with_arguments

CALL_JSON = '{"name": "lookup", "arguments": {"item": "[Item-1153] the blue one, with its full description"}}'
CUT_AFTER = '{"name": "lookup", "arguments": {"item": "[Item-11'
"""Where max_tokens cuts the call: inside its string argument."""


@pytest.fixture
def scripted(tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = scripted_gateway(tiny_model_path, tmp_path / "cut.db")
    yield running
    running.stop()


def _question(api: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}]  # the same shape in the three APIs


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
    engine = engine_of(scripted)
    text = CALL_JSON if forced else "Looking.\n<tool_call>\n" + CALL_JSON + "\n</tool_call>"
    written = CUT_AFTER if forced else "Looking.\n<tool_call>\n" + CUT_AFTER
    engine.replies += [text, "It is blue."]
    conversation = _question(api)
    first = ask(scripted, api, "s", conversation, stream=stream, forced=forced,
                max_tokens=token_count(scripted, written))
    assert_cut_call(api, first, "" if forced else "Looking.")

    conversation += first.echo + tool_result(api, first, "error: the call was cut short")
    ask_plain(scripted, api, "s", conversation, stream=stream)
    assert_one_exact_segment(scripted, "s", 2)


REPAIRED = {"item": "[Item-11]"}


@pytest.mark.parametrize("variant", ["repaired", "dropped", "empty"])
@pytest.mark.parametrize("api", APIS)
def test_every_echo_of_a_cut_call_extends_the_same_segment(scripted: RunningGateway, api: str, variant: str) -> None:
    """The agent repairs the arguments, or drops them, then on the next turn sends them as first given: the
    three calls are one segment all the same."""
    engine = engine_of(scripted)
    engine.replies += ["<tool_call>\n" + CALL_JSON, "Let me retry.", "Fine."]
    conversation = _question(api)
    first = ask(scripted, api, "v", conversation, max_tokens=token_count(scripted, "<tool_call>\n" + CUT_AFTER))
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
    engine = engine_of(scripted)
    engine.replies += ["<tool_call>\n" + CALL_JSON, "Sure."]
    first = ask(scripted, "chat", "u", _question("chat"), max_tokens=token_count(scripted, "<tool_call>\n" + CUT_AFTER))
    ask_plain(scripted, "chat", "u", [*_question("chat"), *first.echo, {"role": "user", "content": "Shorter."}])
    assert_one_exact_segment(scripted, "u", 2)


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_whole_call_whose_arguments_are_not_json_is_a_call_with_them_as_written(
        scripted: RunningGateway, api: str) -> None:
    engine = engine_of(scripted)
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
    engine = engine_of(scripted)
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
    engine_of(scripted).replies.append(written)
    reply = OpenAI(base_url=scripted.v1("b"), api_key="unused").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[LOOKUP])
    assert reply.choices[0].message.content == content and reply.choices[0].finish_reason == finish
