"""The Anthropic Messages API through the real `anthropic` SDK: text, streaming events, a tool-use
loop that stays one token-exact trajectory, a session mixing APIs, and bad input in Anthropic's shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine, is_produced, trained_token_count
from tests.support.servers import RunningGateway
from tests.support.tool_model import ADD_TOOL, ANSWER, GREETING, QUESTION
from tracetrain.proxy.redact import filler_id

MODEL = "tool-tiny"
REPO = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0}
"""The SDK (2.x) no longer takes sampling parameters as arguments; the API and the gateway still do."""
ADD = {"name": "add", "description": ADD_TOOL["function"]["description"],
       "input_schema": ADD_TOOL["function"]["parameters"]}


def _client(gw: RunningGateway, session: str) -> anthropic.Anthropic:
    # ANTHROPIC_BASE_URL=…/s/{session}: the SDK appends /v1/messages
    return anthropic.Anthropic(base_url=f"{gw.url}/s/{session}", api_key="unused", max_retries=0)


def _session(gw: RunningGateway, session: str) -> dict[str, Any]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}").json()  # type: ignore[no-any-return]


def test_text_reply_matches_chat_completions(tool_gateway: RunningGateway) -> None:
    reply = _client(tool_gateway, "msg-text").messages.create(
        model=MODEL, max_tokens=32, extra_body=GREEDY, messages=[{"role": "user", "content": GREETING[0]}])
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == GREETING[1]  # type: ignore[union-attr]
    assert reply.stop_reason == "end_turn" and reply.usage.output_tokens > 0
    chat = OpenAI(base_url=tool_gateway.v1("chat-text"), api_key="unused").chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": GREETING[0]}])
    assert chat.choices[0].message.content == GREETING[1]
    (call,) = _session(tool_gateway, "msg-text")["calls"]
    assert call["completion_id"] == reply.id and call["prompt_tokens"] == reply.usage.input_tokens


def test_streaming_sends_anthropics_events(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway, "msg-stream")
    with client.messages.stream(model=MODEL, max_tokens=32, extra_body=GREEDY,
                                messages=[{"role": "user", "content": GREETING[0]}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == 1 and kinds.count("content_block_stop") == 1
    assert kinds.count("text") > 3, "text arrives as it is made"
    assert final.content[0].text == GREETING[1] and final.stop_reason == "end_turn"  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_loop_is_one_exact_trajectory(tool_gateway: RunningGateway, stream: bool) -> None:
    session = f"msg-tools-{stream}"
    client = _client(tool_gateway, session)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]

    def ask() -> Any:
        if not stream:
            return client.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=[ADD], messages=messages)
        with client.messages.stream(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=[ADD],
                                    messages=messages) as events:
            return events.get_final_message()

    first = ask()
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "add" and use.input == {"a": 2, "b": 3}
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    second = ask()
    assert second.content[0].text == ANSWER and second.stop_reason == "end_turn"
    calls = _session(tool_gateway, session)["calls"]
    assert [c["link"] for c in calls] == ["start", "extend"], "the tool result extends the token chain"
    assert calls[0]["finish_reason"] == "tool_calls"


def test_a_session_may_mix_apis(tool_gateway: RunningGateway) -> None:
    """A chat call, then the same conversation continued over the Messages API: one trajectory."""
    chat = OpenAI(base_url=tool_gateway.v1("mixed"), api_key="unused").chat.completions.create(
        model=MODEL, temperature=0, tools=[ADD_TOOL], messages=[{"role": "user", "content": QUESTION}])
    (call,) = chat.choices[0].message.tool_calls or []
    client = _client(tool_gateway, "mixed")
    client.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=[ADD], messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": "add",
                                           "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]}])
    assert [c["link"] for c in _session(tool_gateway, "mixed")["calls"]] == ["start", "extend"]


def test_count_tokens_is_the_prompt_a_messages_call_then_records(tool_gateway: RunningGateway) -> None:
    """`messages.count_tokens` renders exactly what a Messages call with the same system, tools and messages
    sends, and records nothing."""
    session = "msg-count"
    client = _client(tool_gateway, session)
    ask: Any = {"model": MODEL, "system": [{"type": "text", "text": "You add numbers."}], "tools": [ADD],
                "messages": [{"role": "user", "content": GREETING[0]}]}
    counted = client.messages.count_tokens(**ask)
    assert counted.input_tokens > 0
    unbound = anthropic.Anthropic(base_url=tool_gateway.url, api_key="unused", max_retries=0)
    assert unbound.messages.count_tokens(**ask) == counted
    assert httpx.get(f"{tool_gateway.url}/v1/sessions").json()["total"] == 0, "a count records nothing"
    reply = client.messages.create(**ask, max_tokens=8, extra_body=GREEDY)
    (call,) = _session(tool_gateway, session)["calls"]
    assert counted.input_tokens == call["prompt_tokens"] == reply.usage.input_tokens


def test_count_tokens_follows_the_sessions_token_chain(tool_gateway: RunningGateway) -> None:
    """Under a session path the count is of the prompt the next call extends the session's chain with: after a
    tool_use, the count of the conversation with its tool_result is the next call's recorded prompt."""
    session = "msg-count-chain"
    client = _client(tool_gateway, session)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(model=MODEL, tools=[ADD], messages=messages)
    first = client.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=[ADD], messages=messages)
    assert counted.input_tokens == first.usage.input_tokens
    (use,) = [b for b in first.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    again = client.messages.count_tokens(model=MODEL, tools=[ADD], messages=messages)
    grouped = httpx.post(f"{tool_gateway.url}/s/{session}/g/adders/v1/messages/count_tokens",
                         json={"model": MODEL, "tools": [ADD], "messages": messages})
    assert grouped.status_code == 200 and grouped.json() == {"input_tokens": again.input_tokens}
    assert len(_session(tool_gateway, session)["calls"]) == 1
    second = client.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=[ADD], messages=messages)
    calls = _session(tool_gateway, session)["calls"]
    assert calls[1]["link"] == "extend", "the second call extends the first one's token chain"
    assert again.input_tokens == calls[1]["prompt_tokens"] == second.usage.input_tokens


def test_count_tokens_refuses_what_a_messages_call_refuses(tool_gateway: RunningGateway) -> None:
    client = _client(tool_gateway, "msg-count-bad")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=[{"role": "user", "content": "hi"}])
    for content in ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}],
                    [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "5"}]):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": content}])  # type: ignore[misc]
        assert refused.value.body["type"] == "error"  # type: ignore[index]
    assert httpx.get(f"{tool_gateway.url}/v1/sessions/msg-count-bad").status_code == 404


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "5"}]}]}, "toolu_nope"),
    ({"max_tokens": 8, "tools": [ADD], "tool_choice": {"type": "tool", "name": "sub"},
      "messages": [{"role": "user", "content": "hi"}]}, "sub"),
    ({"max_tokens": 8, "top_k": 5, "messages": [{"role": "user", "content": "hi"}]}, "top_k"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
])
def test_bad_input_is_400_in_anthropics_error_shape(tool_gateway: RunningGateway, body: dict[str, Any],
                                                   fragment: str) -> None:
    response = httpx.post(f"{tool_gateway.url}/s/msg-bad/v1/messages", json={"model": MODEL, **body},
                          headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]
    assert _session(tool_gateway, "msg-bad").get("calls") is None, "nothing was recorded"


def test_unknown_model_is_not_found_for_the_sdk(tool_gateway: RunningGateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        _client(tool_gateway, "msg-404").messages.create(model="claude-nope", max_tokens=8,
                                                         messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


@pytest.mark.vllm
def test_anthropic_tools_example_records_each_episode_as_one_trajectory(vllm_gateway: RunningGateway,
                                                                        tmp_path: Path) -> None:
    """The example runs as a user would run it, on vLLM: a forced tool_use, its tool_result, an answer."""
    out = tmp_path / "episodes.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/agents/anthropic_tools/agent.py"), "--gateway",
                    vllm_gateway.url, "--model", vllm_gateway.gateway.config.engine.served_model_name,
                    "--episodes", "2", "--group-size", "2", "--out", str(out)], check=True, timeout=600)
    episodes = [json.loads(line) for line in out.read_text().splitlines()]
    engine = vllm_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine) and len(episodes) == 2
    filler = filler_id(vllm_gateway.gateway.renderer)
    for episode in episodes:
        url = f"{vllm_gateway.url}/v1/sessions/{episode['session_id']}"
        info = httpx.get(url, timeout=30).json()
        assert [c["completion_id"] for c in info["calls"]] == episode["message_ids"]
        # A forced call cut off by max_tokens cannot be parsed: the agent then gets text, no tool_use.
        called = info["calls"][0]["finish_reason"] == "tool_calls"
        assert episode["tool_calls"] == int(called)
        assert info["status"] == "final" and [r["value"] for r in info["rewards"]] == [episode["reward"]]
        (trajectory,) = httpx.get(f"{url}/trajectory", timeout=30).json()["trajectories"]
        if called:
            (segment,) = trajectory["segments"]  # the tool result extended the forced call's chain
            assert sum(segment["loss_mask"]) == trained_token_count(info["calls"])
        for segment in trajectory["segments"]:
            assert is_produced(segment["token_ids"], engine.generations, filler)
