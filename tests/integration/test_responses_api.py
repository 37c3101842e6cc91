"""The Responses API through the real OpenAI SDK: text, reading a response back, a tool loop chained by
previous_response_id (and the same loop sent whole) as one exact trajectory, streaming events, bad input."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.servers import RunningGateway
from tests.support.tool_model import ADD_TOOL, ANSWER, GREETING, QUESTION

MODEL = "tool-tiny"
ADD = {"type": "function", **ADD_TOOL["function"]}


def _client(gw: RunningGateway, session: str | None = None) -> OpenAI:
    return OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=0)


def _calls(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}").json()["calls"]  # type: ignore[no-any-return]


def test_text_reply_and_reading_it_back(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway, "resp-text")
    reply = client.responses.create(model=MODEL, input=GREETING[0], temperature=0)
    assert reply.id.startswith("resp_") and reply.status == "completed"
    assert reply.output_text == GREETING[1] and reply.usage is not None and reply.usage.output_tokens > 0
    again = client.responses.retrieve(reply.id)
    assert again.output_text == GREETING[1] and again.output[0].id == reply.output[0].id


def test_a_tool_loop_by_previous_response_id_is_one_exact_trajectory(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway)
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[ADD], temperature=0)  # type: ignore[list-item]
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and call.arguments == '{"a": 2, "b": 3}'
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[ADD], temperature=0,  # type: ignore[list-item]
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert second.output_text == ANSWER
    # an unbound first call is a session named after it; the chained call continues that session
    assert [c["link"] for c in _calls(tool_gateway, first.id)] == ["start", "extend"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_same_loop_sent_whole_chains_too(tool_gateway: RunningGateway, stream: bool) -> None:
    session = f"resp-whole-{stream}"
    client = _client(tool_gateway, session)

    def ask(items: Any) -> Any:
        if not stream:
            return client.responses.create(model=MODEL, input=items, tools=[ADD], temperature=0)
        with client.responses.stream(model=MODEL, input=items, tools=[ADD], temperature=0) as events:
            kinds = [event.type for event in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            return events.get_final_response()

    items: list[Any] = [{"role": "user", "content": QUESTION}]
    first = ask(items)
    (call,) = [item for item in first.output if item.type == "function_call"]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    assert ask(items).output_text == ANSWER
    assert [c["link"] for c in _calls(tool_gateway, session)] == ["start", "extend"]


def test_streamed_text_arrives_as_deltas(tool_gateway: RunningGateway) -> None:
    events = list(_client(tool_gateway, "resp-stream").responses.create(
        model=MODEL, input=GREETING[0], temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == GREETING[1]
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize(("change", "fragment"), [
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "5"}]}, "call_nope"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "sub"),
])
def test_bad_input_is_400_and_records_nothing(tool_gateway: RunningGateway, change: dict[str, Any],
                                              fragment: str) -> None:
    response = httpx.post(f"{tool_gateway.url}/s/resp-bad/v1/responses",
                          json={"model": MODEL, "input": "hi", **change})
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]
    assert httpx.get(f"{tool_gateway.url}/v1/sessions/resp-bad").status_code == 404


def test_unknown_and_unstored_responses_are_not_found(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway, "resp-nostore")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    hidden = client.responses.create(model=MODEL, input=GREETING[0], store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(hidden.id)
    assert len(_calls(tool_gateway, "resp-nostore")) == 1, "recorded for training all the same"
