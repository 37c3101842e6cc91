"""The gateway's batched event stream (proxy/event_stream.py) against Starlette's plain StreamingResponse,
over real HTTP: uvicorn on a free port, as the gateway serves its streams."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from urllib.parse import parse_qs

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.support.servers import free_port
from tracetrain.proxy.event_stream import FLUSH, EventStream

SEQUENCES = 80
"""Random event sequences per run, each sent through both responses."""

_WORDS = ["hello", " ", "wörld", "日本語", "🙂", "\u200d", "\\n", '"', "\n", "data:", "[DONE]", "é", "\u2028",
          "x" * 300]


def _events(seed: int) -> list[bytes | str | memoryview]:
    """A random event sequence: server-sent events as bytes, str or memoryview, FLUSH markers and other empty
    events, unicode cut nowhere (each event is whole), now and then one large event."""
    rng = random.Random(seed)
    events: list[bytes | str | memoryview] = []
    for _ in range(rng.randint(0, 40)):
        kind = rng.random()
        if kind < 0.15:
            events.append(FLUSH)
        elif kind < 0.2:
            events.append(rng.choice(["", memoryview(b"")]))  # empty in another type: a flush too
        else:
            text = "".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 12)))
            if rng.random() < 0.03:
                text *= 500
            event = f"data: {json.dumps({'delta': text}, ensure_ascii=rng.random() < 0.5)}\n\n"
            events.append(rng.choice([event.encode(), event, memoryview(event.encode())]))
    return events


async def _body(events: list[bytes | str | memoryview], seed: int) -> AsyncIterator[bytes | str | memoryview]:
    """The events, yielding to the loop at random between them, as a generation's body waits for tokens."""
    rng = random.Random(seed)
    for event in events:
        if rng.random() < 0.3:
            await asyncio.sleep(0 if rng.random() < 0.8 else 0.001)
        yield event


FINISHED: dict[str, threading.Event] = {}
"""A stream's token -> set when its body's `finally` ran."""


async def _forever(token: str) -> AsyncIterator[bytes]:
    """A body that only ends when its response cancels it (the client left)."""
    try:
        n = 0
        while True:
            yield f"data: {n}\n\n".encode()
            n += 1
            await asyncio.sleep(0.005)
    finally:
        FINISHED[token].set()


def _respond(request: Request) -> Response:
    """`?kind=batched` the gateway's EventStream, `?kind=plain` the reference; `seed` picks the events and the
    batched response's `ready` answers; `forever=token` sends an endless stream instead."""
    kind, seed = request.query_params["kind"], int(request.query_params.get("seed", 0))
    token = request.query_params.get("forever")
    content = _forever(token) if token else _body(_events(seed), seed + 1)
    headers = {"x-seed": str(seed), "cache-control": "no-cache"}
    if kind == "batched":
        ready = random.Random(seed + 2)
        return EventStream(content, ready=lambda: ready.random() < 0.6, headers=headers)
    return StreamingResponse(content, headers=headers, media_type="text/event-stream")


WRITES: dict[str, int] = {}
"""The body writes (`http.response.body` messages) each kind of response sent, over all sequences."""


def _counting(app: ASGIApp) -> ASGIApp:
    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        kind = parse_qs(scope["query_string"].decode()).get("kind", ["?"])[0]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.body":
                WRITES[kind] = WRITES.get(kind, 0) + 1
            await send(message)
        await app(scope, receive, counting_send if scope["type"] == "http" else send)
    return counted


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    app = _counting(Starlette(routes=[Route("/stream", _respond)]))
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(timeout=30)


def _received(client: httpx.Client, url: str, kind: str, seed: int) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    response = client.get(f"{url}/stream", params={"kind": kind, "seed": seed})
    headers = [(k, v) for k, v in response.headers.raw if k.lower() != b"date"]
    return response.status_code, headers, response.content


def test_batched_stream_sends_the_bytes_a_plain_stream_sends(server: str) -> None:
    """Fences EventStream's batching (events gathered into one write while `ready`, FLUSH sending what is
    gathered) with the reference, Starlette's plain StreamingResponse sending every event on its own: for
    random event sequences with FLUSH markers, empty events, unicode and large events, and random `ready`
    answers, a client receives the same status, headers and bytes from both."""
    with httpx.Client(timeout=30) as client:
        for seed in range(SEQUENCES):
            batched = _received(client, server, "batched", seed)
            assert batched == _received(client, server, "plain", seed), f"seed {seed}"
            expected = b"".join(e.encode() if isinstance(e, str) else bytes(e) for e in _events(seed))
            assert batched[2] == expected, f"seed {seed}"
    assert WRITES["batched"] < WRITES["plain"] / 2, "the batched response sent its events one by one"


@pytest.mark.parametrize("kind", ["batched", "plain"])
def test_a_client_leaving_mid_stream_ends_the_body(server: str, kind: str) -> None:
    """Fences EventStream's own disconnect watch (one task instead of Starlette's task group) with the
    reference, StreamingResponse's watch: a client that leaves mid-stream cancels the body, whose `finally`
    runs (the gateway's cancels the engine request), in both."""
    token = f"{kind}-{time.monotonic_ns()}"
    FINISHED[token] = threading.Event()
    with httpx.Client(timeout=30) as client, \
            client.stream("GET", f"{server}/stream", params={"kind": kind, "forever": token}) as response:
        received = b""
        for chunk in response.iter_raw():
            received += chunk
            if received.count(b"\n\n") >= 3:
                break  # leave mid-stream: closing the response closes its connection
    assert received.startswith(b"data: 0\n\ndata: 1\n\n")
    assert FINISHED[token].wait(timeout=10), "the body kept running after its client left"
