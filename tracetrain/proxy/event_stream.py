"""The response of every streamed generation: server-sent events, stopped when the client leaves.

Events that are ready together leave together: `ready` says whether the body has its next event
without waiting (the engine's tokens already queued), and while it does, events are gathered into one
write. Each write is a trip through the middleware and a syscall that wakes the client; a stream of
role, text, final and `[DONE]` events cost five of them where two do. A body about to wait for something
`ready` cannot see (the call's record) yields `FLUSH` first, so that its text does not wait with it.

Starlette's `StreamingResponse` watches for the client's disconnect with an anyio task group per
response (under uvicorn, whose ASGI spec version is below 2.4); that group was a visible share of the
gateway's CPU on streamed calls when profiled. Here the watch is one plain task whose completion
cancels the task sending the body: the same behaviour, a client that leaves stops its generation at
once (the body's `finally` cancels the engine request), for less.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

FLUSH = b""
"""Yielded by a stream's body before it waits: send what is gathered now."""


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], *, ready: Callable[[], bool],
                 headers: Mapping[str, str] | None = None, on_drop: Callable[[], None] | None = None) -> None:
        super().__init__(content, headers=headers)
        self.ready = ready
        self.on_drop = on_drop
        """Called when the client leaves before the stream's end."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        gathered: list[bytes] = []
        async for chunk in self.body_iterator:
            if chunk:
                gathered.append(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
            if gathered and (not chunk or not self.ready()):
                await send({"type": "http.response.body", "body": b"".join(gathered), "more_body": True})
                gathered.clear()
        await send({"type": "http.response.body", "body": b"".join(gathered), "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        body = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(_disconnect(receive))
        watch.add_done_callback(lambda _: body.cancel())  # a no-op once the body is sent
        try:
            await body
        except asyncio.CancelledError:
            if not watch.done() or watch.cancelled():
                raise  # cancelled from outside (the server shutting down), not by the client leaving
            if self.on_drop is not None:
                self.on_drop()
        finally:
            watch.cancel()
            body.cancel()
        if self.background is not None:
            await self.background()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
