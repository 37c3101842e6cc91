"""The template's tool-call markup never reaches a reply's text, whatever the model wrote around its calls,
through each API's real SDK, streamed and not: a whole call beside a block the parser cannot read, a reply
cut by max_tokens inside the opener `<tool_call>` itself, whole calls the limit reached just after, a
forced call that names no tool. Each has its API's shape, and the agent's echo extends the same trajectory,
with the sampled tokens, and only those, in the loss. Calls cut short by the limit are in
test_cut_tool_calls.py.
"""

from __future__ import annotations

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
from tests.support.tool_turns import LOOKUP, QUESTION, Turn, tool_result

WHOLE = '<tool_call>\n{"name": "lookup", "arguments": {"item": "x"}}\n</tool_call>'
TEXT = "Checking.\n"
UNREADABLE = {
    # (what the model writes after a whole call, where max_tokens cuts it (None: no cut), what the
    # OpenAI APIs give as the second call's arguments)
    "not_json": ("\n<tool_call>\n{name: add, arguments: {a: 1}}\n</tool_call>", None, "{name: add, arguments: {a: 1}}"),
    "unclosed": ('\n<tool_call>\n{"na', None, '{"na'),  # the model ended its turn in the block
    "cut": ('\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', '\n<tool_call>\n{"', ""),
}
GO_ON = [{"role": "user", "content": "Go on."}]  # the same shape in the three APIs
STOPS = {  # (calls whole, a call cut) in each API's words
    "chat": ("tool_calls", "length"), "responses": ("completed", "incomplete"), "messages": ("tool_use", "max_tokens")}


@pytest.fixture
def scripted(tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = scripted_gateway(tiny_model_path, tmp_path / "markup.db")
    yield running
    running.stop()


def _question() -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}]  # the same shape in the three APIs


@pytest.mark.parametrize("variant", list(UNREADABLE))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_whole_call_beside_a_block_that_cannot_be_read_comes_back_with_it(
        scripted: RunningGateway, api: str, stream: bool, variant: str) -> None:
    """The unreadable block is a call too, with no name and the block as written for arguments (as a call
    whose arguments are not JSON comes back), or cut short: never the reply's text with the calls in it."""
    after, cut_after, arguments = UNREADABLE[variant]
    engine = engine_of(scripted)
    engine.replies += [TEXT + WHOLE + after, "It is x."]
    limit = token_count(scripted, TEXT + WHOLE + cut_after) if cut_after else 64
    first = ask(scripted, api, "u", _question(), stream=stream, max_tokens=limit, calls=2)

    cut = cut_after is not None
    assert first.stop == STOPS[api][cut] and first.content == TEXT.strip()
    whole, unread = first.calls
    assert (whole.name, unread.name) == ("lookup", "")
    if api == "messages":
        assert whole.arguments == {"item": "x"} and unread.arguments == {}  # what of them can be read
    else:
        assert whole.arguments == '{"item": "x"}' and unread.arguments == arguments
    if api == "responses":
        assert (whole.status, unread.status) == ("completed", "incomplete" if cut else "completed")
        assert first.incomplete == ({"reason": "max_output_tokens"} if cut else None)

    ask_plain(scripted, api, "u", [*_question(), *first.echo, *tool_result(api, first, "error: not understood")],
              stream=stream)
    assert_one_exact_segment(scripted, "u", 2)


@pytest.mark.parametrize("fragment", ["\n<", "\n<tool", "\n<tool_call"], ids=["lt", "tool", "no_gt"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_reply_cut_inside_the_opener_ends_before_it(scripted: RunningGateway, api: str, stream: bool,
                                                       fragment: str) -> None:
    """Streamed, the start of the opener is held back, as before a call; whole, it is left out. The echo
    (text without it) extends the call, whose recorded tokens are the sampled ones, the fragment's too."""
    engine = engine_of(scripted)
    engine.replies += ["It is blue." + WHOLE.replace("<tool_call>", "\n<tool_call>", 1), "Fine."]
    first = ask(scripted, api, "o", _question(), stream=stream,
                max_tokens=token_count(scripted, "It is blue." + fragment), calls=0)
    assert first.content == "It is blue."
    assert first.stop == {"chat": "length", "responses": "incomplete", "messages": "max_tokens"}[api]
    if api == "responses":
        assert first.incomplete == {"reason": "max_output_tokens"}
        assert [item["status"] for item in first.echo] == ["incomplete"]  # the message's text is cut
    assert engine.tokenizer.decode(engine.samples[-1]) == "It is blue." + fragment

    ask_plain(scripted, api, "o", [*_question(), *first.echo, *GO_ON], stream=stream)
    assert_one_exact_segment(scripted, "o", 2)


@pytest.mark.parametrize("where", ["after", "in_closing_tag"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_whole_calls_the_limit_reached_after_are_a_complete_reply(scripted: RunningGateway, api: str,
                                                                  stream: bool, where: str) -> None:
    """The limit took the turn end, or part of the closing tag: every call is whole, so the reply is not cut
    (a Responses response `completed`, as Chat Completions says `tool_calls` and Messages `tool_use`)."""
    engine = engine_of(scripted)
    engine.replies += [WHOLE, "It is x."]
    written = WHOLE if where == "after" else WHOLE.removesuffix("call>")
    first = ask(scripted, api, "w", _question(), stream=stream, max_tokens=token_count(scripted, written))
    assert engine.tokenizer.decode(engine.samples[-1]) == written  # the engine stopped on length
    assert first.stop == STOPS[api][False] and first.name == "lookup"
    if api == "responses":
        assert first.incomplete is None and first.call_status == "completed"
        _assert_read_back(scripted, "w", first)
    ask_plain(scripted, api, "w", [*_question(), *first.echo, *tool_result(api, first, "x: found")], stream=stream)
    assert_one_exact_segment(scripted, "w", 2)


def _assert_read_back(gw: RunningGateway, session: str, turn: Turn) -> None:
    """A stored response read back has the status and items it was answered with."""
    (call,) = httpx.get(f"{gw.url}/v1/sessions/{session}").json()["calls"]
    stored = OpenAI(base_url=gw.v1(session), api_key="unused").responses.retrieve(call["completion_id"])
    assert stored.status == turn.stop and stored.incomplete_details is None
    assert [item.model_dump(exclude_none=True) for item in stored.output] == turn.echo


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_forced_call_that_ended_in_its_name_is_still_the_call(scripted: RunningGateway, api: str,
                                                                stream: bool) -> None:
    """A stop string the request gave can end a forced call before its name is read: the request demands a
    call, so it is one, with no name and its text as written, never the opener the gateway put before it."""
    engine = engine_of(scripted)
    engine.replies += ['{"na', "Fine."]
    first = ask(scripted, api, "f", _question(), stream=stream, forced=True)
    assert first.stop == STOPS[api][False] and first.name == "" and first.content == ""
    assert first.arguments == ({} if api == "messages" else '{"na')
    ask_plain(scripted, api, "f", [*_question(), *first.echo, *tool_result(api, first, "error: no name")],
              stream=stream)
    assert_one_exact_segment(scripted, "f", 2)


def test_with_tool_choice_none_a_block_the_model_writes_is_its_text(scripted: RunningGateway) -> None:
    """The request forbids calls, so the model's block is not one: the reply is its text, verbatim, as vLLM
    answers it (dropping it would hide what the model did from the agent). Its echo extends the call."""
    engine = engine_of(scripted)
    engine.replies += [TEXT + WHOLE, "Fine."]
    client = OpenAI(base_url=scripted.v1("n"), api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=_question(),  # type: ignore[arg-type]
                                           tools=[LOOKUP], tool_choice="none")
    message = reply.choices[0].message
    assert (message.content, message.tool_calls, reply.choices[0].finish_reason) == (TEXT + WHOLE, None, "stop")
    echo = {"role": "assistant", "content": message.content}
    client.chat.completions.create(model="tiny", messages=[*_question(), echo, *GO_ON],  # type: ignore
                                   tools=[LOOKUP], tool_choice="none")
    assert_one_exact_segment(scripted, "n", 2)
