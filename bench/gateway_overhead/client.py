"""A lean HTTP/1.1 keep-alive client for the load generator.

On a 2-core machine the load generator competes with the servers it measures, so it should cost as
little CPU per request as possible: one asyncio stream per connection, requests written as one
buffer, responses read by Content-Length or chunked transfer encoding, SSE events split as they
arrive and timed. No redirects, no TLS, no compression: loopback benchmarking only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson


class HTTPFailure(Exception):
    """The connection broke or the server answered something unreadable."""


@dataclass
class Reply:
    status: int
    body: bytes = b""
    """The whole body of a non-streamed reply (empty for streams)."""
    events: list[Any] = field(default_factory=list)
    """The parsed JSON payloads of a stream's `data:` lines, `[DONE]` left out."""
    latency_s: float = 0.0
    """From writing the request to the end of the reply."""
    first_token_s: float | None = None
    """Streams only: until the first event that carries answer text."""
    done: bool = False
    """Streams only: `data: [DONE]` arrived."""

    def json(self) -> Any:
        return orjson.loads(self.body)


def _has_text(event: Any) -> bool:
    """Chat and completions chunks, Responses' `response.output_text.delta`, Anthropic's text deltas."""
    if not isinstance(event, dict):
        return False
    kind = event.get("type")
    if kind == "response.output_text.delta":
        return bool(event.get("delta"))
    if kind == "content_block_delta":
        return bool((event.get("delta") or {}).get("text"))
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if (delta and delta.get("content")) or choice.get("text"):
            return True
    return False


class Connection:
    """One keep-alive connection; reconnects when the server closed it between requests."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None

    async def post(
        self, path: str, payload: Any, *, stream: bool, headers: dict[str, str] | None = None
    ) -> Reply:
        body = orjson.dumps(payload)
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        for attempt in (0, 1):
            fresh = self._writer is None
            if fresh:
                await self._connect()
            started = time.perf_counter()
            try:
                return await self._exchange(request, stream, started)
            except _StaleConnection as exc:
                await self.close()  # the server dropped an idle keep-alive connection: reconnect once
                if fresh or attempt:
                    raise HTTPFailure(str(exc)) from exc
            except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
                await self.close()
                raise HTTPFailure(f"{type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    async def _exchange(self, request: bytes, stream: bool, started: float) -> Reply:
        assert self._reader is not None and self._writer is not None
        reader = self._reader
        try:
            self._writer.write(request)
            await self._writer.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _StaleConnection(f"{type(exc).__name__} on send") from exc
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise _StaleConnection("closed before answering") from exc  # keep-alive timed out
            raise
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
        reply = Reply(status=status)
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if stream and status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
            await self._read_stream(reply, chunked, headers, started)
        elif chunked:
            reply.body = b"".join([part async for part in self._chunks()])
        else:
            reply.body = await reader.readexactly(int(headers.get("content-length", "0")))
        reply.latency_s = time.perf_counter() - started
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return reply

    async def _chunks(self) -> AsyncIterator[bytes]:
        assert self._reader is not None
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await self._reader.readuntil(b"\r\n")
                return
            data = await self._reader.readexactly(size + 2)
            yield data[:-2]

    async def _read_stream(
        self, reply: Reply, chunked: bool, headers: dict[str, str], started: float
    ) -> None:
        assert self._reader is not None
        buffer = b""
        if chunked:
            parts = self._chunks()
        else:
            parts = _single(await self._reader.readexactly(int(headers.get("content-length", "0"))))
        async for part in parts:
            buffer += part
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                # Responses and Anthropic events carry an `event:` line before their `data:` line.
                data = next((line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")), None)
                if data is None:
                    continue
                if data == b"[DONE]":
                    reply.done = True
                    continue
                parsed = orjson.loads(data)
                reply.events.append(parsed)
                if reply.first_token_s is None and _has_text(parsed):
                    reply.first_token_s = time.perf_counter() - started


async def _single(data: bytes) -> AsyncIterator[bytes]:
    yield data


class _StaleConnection(Exception):
    pass
