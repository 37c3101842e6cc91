"""SDK retries and reconnects never split a trajectory: the real OpenAI and Anthropic SDKs retry after an
engine error and after a response lost on its way back, a raw client reconnects after leaving a stream,
and every session stays one trajectory of one segment, token for token what the agent continued from."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI
from sqlmodel import Session

from tests.support.recording import Generation, RecordingEngine, assert_one_exact_segment
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.base import Affinity, EngineError, SamplingParams, TokenDelta
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.store.models import AgentSession


class FlakyEngine:
    """Fails the calls numbered in `failing` (0-based, counted over every generate) with an engine error
    before sampling anything, as a replica that drops a request does; the gateway answers it with a 502."""

    def __init__(self, inner: RecordingEngine) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.failing: set[int] = set()
        self.tries = 0

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        self.tries += 1
        if self.tries - 1 in self.failing:
            raise EngineError("replica dropped the request")
        async for delta in self.inner.generate(prompt_ids, params, affinity):
            yield delta

    async def close(self) -> None:
        """The wrapped engine belongs to the test fixture that made it."""


@pytest.fixture
def flaky(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = start_gateway(FlakyEngine(RecordingEngine(tiny_engine)), tiny_model_path,
                            f"sqlite:///{tmp_path / 'gw.db'}")
    yield running
    running.stop()


def _engine(gw: RunningGateway) -> FlakyEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, FlakyEngine)
    return engine


def _one_segment(gw: RunningGateway, session: str, generations: list[Generation]) -> dict[str, Any]:
    response = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory")
    response.raise_for_status()
    (trajectory,) = response.json()["trajectories"]
    return assert_one_exact_segment(trajectory, generations)


def _calls(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}").json()["calls"]  # type: ignore[no-any-return]


class Losing:
    """A transport that delivers requests but loses the responses numbered in `losing` on their way back
    (the server answered and recorded the call; the client sees a dropped connection), as a flaky network
    does. `http` is the HTTP package the SDK was built on (httpx, or httpx2 for newer Anthropic SDKs)."""

    def __init__(self, losing: set[int]) -> None:
        self.losing = losing
        self.sent = 0
        self.retry_headers: list[str | None] = []

    def client(self, http: Any) -> Any:
        losing = self

        class Transport(http.HTTPTransport):  # type: ignore[misc, name-defined]
            def handle_request(self, request: Any) -> Any:
                losing.sent += 1
                losing.retry_headers.append(request.headers.get("x-stainless-retry-count"))
                response = super().handle_request(request)
                if losing.sent - 1 in losing.losing:
                    response.read()
                    response.close()
                    raise http.ReadError("connection reset by peer", request=request)
                return response

        return http.Client(transport=Transport())


def _http_package(sdk_client: Any) -> Any:
    packages = (cls.__module__.partition(".")[0] for cls in type(sdk_client._client).__mro__)
    return sys.modules[next(p for p in packages if p.startswith("httpx"))]


def _openai(gw: RunningGateway, session: str, losing: Losing | None = None) -> Callable[..., str]:
    client = OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=2)
    if losing is not None:
        client = client.with_options(http_client=losing.client(_http_package(client)))

    def ask(messages: list[dict[str, Any]], stream: bool) -> str:
        if not stream:
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)  # type: ignore[arg-type]
            return reply.choices[0].message.content or ""
        chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True)  # type: ignore[arg-type]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # type: ignore[union-attr]

    return ask


def _anthropic(gw: RunningGateway, session: str, losing: Losing | None = None) -> Callable[..., str]:
    client = anthropic.Anthropic(base_url=f"{gw.url}/s/{session}", api_key="unused", max_retries=2)
    if losing is not None:
        client = client.with_options(http_client=losing.client(_http_package(client)))

    def ask(messages: list[dict[str, Any]], stream: bool) -> str:
        if not stream:
            reply = client.messages.create(model="tiny", max_tokens=8, messages=messages)  # type: ignore[arg-type]
            return "".join(b.text for b in reply.content if b.type == "text")
        with client.messages.stream(model="tiny", max_tokens=8, messages=messages) as events:  # type: ignore[arg-type]
            return "".join(events.text_stream)

    return ask


CLIENTS = {"openai": _openai, "anthropic": _anthropic}


def _conversation(ask: Callable[..., str], stream: bool, turns: int = 2) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me: one"}]
    for turn in range(turns):
        reply = ask(messages, stream)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and {turn + 2}?"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sdk", sorted(CLIENTS))
def test_a_retry_after_an_engine_error_is_not_a_second_call(flaky: RunningGateway, sdk: str, stream: bool) -> None:
    engine = _engine(flaky)
    engine.failing = {0, 2}  # the first try of each turn
    session = f"fail-{sdk}-{stream}"
    _conversation(CLIENTS[sdk](flaky, session), stream)
    assert engine.tries == 4
    assert len(_calls(flaky, session)) == 2
    _one_segment(flaky, session, engine.inner.generations)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sdk", sorted(CLIENTS))
def test_a_retry_after_a_lost_response_replaces_the_recorded_call(flaky: RunningGateway, sdk: str,
                                                                   stream: bool) -> None:
    """The first turn's and the second turn's responses are lost after the gateway recorded them; the SDK
    retries with its retry header and the retry's call takes the lost one's place."""
    losing = Losing({0, 2})
    session = f"lost-{sdk}-{stream}"
    _conversation(CLIENTS[sdk](flaky, session, losing), stream)
    assert [h or "0" for h in losing.retry_headers] == ["0", "1", "0", "1"]
    generations = _engine(flaky).inner.generations
    assert len(generations) == 4
    calls = _calls(flaky, session)
    assert [c["link"] for c in calls] == ["start", "extend"]
    # What the session keeps is what the client saw: the retries' calls, not the lost ones.
    _one_segment(flaky, session, [generations[1], generations[3]])


def test_a_retry_keeps_a_reward_posted_for_the_lost_call(flaky: RunningGateway) -> None:
    """A reward that names the replaced call (by its id, which the client never got but a framework may
    have logged) moves to the retry's call."""
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    first = httpx.post(f"{flaky.v1('reward-retry')}/chat/completions", json=body).json()
    reward = httpx.post(f"{flaky.url}/v1/rewards",
                        json={"session_id": "reward-retry", "completion_id": first["id"], "reward": 1.0})
    assert reward.status_code == 200, reward.text
    retry = httpx.post(f"{flaky.v1('reward-retry')}/chat/completions", json=body,
                       headers={"x-stainless-retry-count": "1"}).json()
    session = httpx.get(f"{flaky.url}/v1/sessions/reward-retry").json()
    (call,) = session["calls"]
    assert call["id"] == f"{retry['id']}-0" and session["reward"] == 1.0
    assert [r["call_id"] for r in session["rewards"]] == [call["id"]]
    with Session(flaky.gateway.db) as db:
        stored = db.get(AgentSession, "reward-retry")
        assert stored is not None and stored.calls == 1
        assert stored.tokens == call["prompt_tokens"] + call["completion_tokens"]


def test_the_same_request_without_a_retry_header_is_a_branch(flaky: RunningGateway) -> None:
    """Asking the same thing twice on purpose (sampling it again) is not a retry: both calls stay."""
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        assert httpx.post(f"{flaky.v1('again')}/chat/completions", json=body).status_code == 200
    assert len(_calls(flaky, "again")) == 2


def test_a_reconnect_after_a_dropped_stream_replaces_the_recorded_call(flaky: RunningGateway) -> None:
    """The client leaves a stream after its call was recorded but before the stream's end, then sends the
    same request again (no retry header): the new call takes the recorded one's place."""
    committed = threading.Event()
    writer = flaky.gateway.writer
    submit = writer.submit

    async def slow_submit(fn: Any) -> Any:
        result = await submit(fn)
        with Session(flaky.gateway.db) as db:
            if db.get(AgentSession, "reconnect") is None:
                return result  # another write (the search index's)
        committed.set()
        await asyncio.sleep(2)  # the client leaves in here, before the stream's last events
        return result

    body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    url = f"{flaky.v1('reconnect')}/chat/completions"
    writer.submit = slow_submit  # type: ignore[method-assign, assignment]
    try:
        with httpx.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            assert committed.wait(30)
    finally:
        writer.submit = submit  # type: ignore[method-assign]
    (dropped,) = _calls(flaky, "reconnect")
    with httpx.stream("POST", url, json=body) as response:
        assert "[DONE]" in response.read().decode()
    (call,) = _calls(flaky, "reconnect")
    assert call["id"] != dropped["id"] and call["link"] == "start"
    _one_segment(flaky, "reconnect", [_engine(flaky).inner.generations[-1]])
