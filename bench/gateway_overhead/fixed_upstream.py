"""A fast fixed-output upstream speaking the vLLM 0.32 OpenAI dialect the gateway uses.

- `POST /v1/completions` with `prompt` as a list of token ids (what `VLLMEngine` sends): always
  answers the same K token ids, with their logprobs and text, `prompt_token_ids` echoed on the first
  stream chunk (or in the choice, non-streaming), `token_ids` per chunk, one chunk per token, then
  `data: [DONE]`. Field names and presence follow vLLM's `CompletionStreamResponse` dumped with
  `exclude_unset=True` (streaming) and `CompletionResponse` dumped whole (non-streaming).
- `POST /v1/chat/completions` (stream or not): the same answer in OpenAI chat shape, as vLLM sends
  it; the "direct" baseline of `bench.gateway_overhead`.
- `GET /health`: 200.

It is a bare ASGI app on uvicorn (uvloop + httptools when installed) that does as little as it can:
chunks are pre-serialized per answer length and only the request id, timestamp and echoed prompt are
spliced in. `max_tokens` below K truncates the answer (finish_reason `length`); `--token-delay-ms`
adds a pause per token to stand in for a slower engine.

    python -m bench.gateway_overhead.fixed_upstream --port 8199 [--workers 2] [--answer answer.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from bench.gateway_overhead.fixed_answer import FINAL_TAIL, FINGERPRINT, Answer, Renderer, chunk_head, usage_json

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

CONFIG_ENV = "BENCH_UPSTREAM_CONFIG"


@dataclass(frozen=True)
class Settings:
    answer: Answer
    token_delay_s: float = 0.0


class FixedUpstream:
    """The ASGI app."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.answer = settings.answer
        self.render = Renderer(settings.answer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = await generation_request(scope, receive, send)
        if request is None:
            return
        path, body = request
        n = min(
            len(self.answer.token_ids),
            int(body.get("max_tokens") or body.get("max_completion_tokens") or len(self.answer.token_ids)),
        )
        if path == "/v1/completions":
            await self.completions(body, n, send)
        else:
            await self.chat(body, n, send)

    async def completions(self, body: dict[str, Any], n: int, send: Send) -> None:
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            await _respond(
                send, 400, b'{"error":{"message":"prompt must be a list of token ids","code":400}}'
            )
            return
        k = body.get("logprobs")
        ids = bool(body.get("return_token_ids"))
        request_id = f"cmpl-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        model = body.get("model", "fixed")
        if not body.get("stream"):
            choice = {**self.render.completion_choice(n, k, ids), "prompt_token_ids": prompt if ids else None}
            payload = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": FINGERPRINT,
                "usage": usage_json(len(prompt), n),
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
            await _respond(send, 200, orjson.dumps(payload))
            return
        first, chunks = self.render.completion_stream_choices(n, k, ids)
        head = chunk_head(request_id, "text_completion", created, model)
        await _start_stream(send)
        for i, (serialized, tail) in enumerate(chunks):
            if i == 0:
                serialized = orjson.dumps({**first, "prompt_token_ids": prompt if ids else None})
            await self._pause()
            await _send_more(send, head + serialized + tail)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def chat(self, body: dict[str, Any], n: int, send: Send) -> None:
        request_id = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        model = body.get("model", "fixed")
        prompt_tokens = sum(len(str(m.get("content") or "")) // 4 for m in body.get("messages") or [])
        if not body.get("stream"):
            payload = {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": self.answer.text(n),
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": self.answer.finish(n),
                        "stop_reason": None,
                        "token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": FINGERPRINT,
                "usage": usage_json(prompt_tokens, n),
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
            await _respond(send, 200, orjson.dumps(payload))
            return
        head = chunk_head(request_id, "chat.completion.chunk", created, model)
        await _start_stream(send)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = self.render.chat_stream_choices(n)
        for i, (choice, tail) in enumerate(chunks):
            await self._pause()
            final = i == len(chunks) - 1 and not include_usage
            await _send_more(send, head + choice + (FINAL_TAIL if final else tail))
        if include_usage:
            usage = {k: v for k, v in usage_json(prompt_tokens, n).items() if v is not None}
            data = b'],"usage":' + orjson.dumps(usage) + b',"system_fingerprint":"' + FINGERPRINT.encode()
            await _send_more(send, head + data + b'"}\n\n')
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _pause(self) -> None:
        if self.settings.token_delay_s:
            await asyncio.sleep(self.settings.token_delay_s)


async def generation_request(scope: Scope, receive: Receive, send: Send) -> tuple[str, dict[str, Any]] | None:
    """Everything but generation: the lifespan protocol, `/health`, 404 and bad JSON answered here; for a
    POST to `/v1/completions` or `/v1/chat/completions`, its path and JSON body."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return None
    if scope["type"] != "http":
        return None
    path, method = scope["path"], scope["method"]
    if method == "GET" and path == "/health":
        await _respond(send, 200, b"", b"text/plain")
        return None
    if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
        await _respond(send, 404, b'{"error":{"message":"not found","code":404}}')
        return None
    try:
        return path, orjson.loads(await _read_body(receive))
    except orjson.JSONDecodeError:
        await _respond(send, 400, b'{"error":{"message":"invalid JSON","code":400}}')
        return None


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _start_stream(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
        }
    )


async def _send_more(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


def create_app() -> FixedUpstream:
    """uvicorn factory: settings come from $BENCH_UPSTREAM_CONFIG so that every worker sees them."""
    raw = orjson.loads(os.environ.get(CONFIG_ENV) or b"{}")
    answer = Answer.from_json(raw["answer"]) if raw.get("answer") else Answer.default()
    return FixedUpstream(Settings(answer=answer, token_delay_s=float(raw.get("token_delay_ms", 0)) / 1000))


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from rich.console import Console

    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway_overhead.fixed_upstream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (default 1)")
    parser.add_argument(
        "--answer",
        help="JSON file: {token_ids, pieces, tokens, ends_with_eos} (default: "
        "16 made-up ids, the last one EOS id 2)",
    )
    parser.add_argument("--answer-json", help="the same, inline")
    parser.add_argument(
        "--token-delay-ms", type=float, default=0.0, help="pause before each token (default 0)"
    )
    args = parser.parse_args(argv)
    answer: dict[str, Any] | None = None
    if args.answer:
        with open(args.answer, "rb") as f:
            answer = orjson.loads(f.read())
    elif args.answer_json:
        answer = orjson.loads(args.answer_json)
    os.environ[CONFIG_ENV] = orjson.dumps({"answer": answer, "token_delay_ms": args.token_delay_ms}).decode()
    tokens = len(answer["token_ids"]) if answer else len(Answer.default().token_ids)
    Console(stderr=True).print(
        f"[bold]fixed upstream[/] on http://{args.host}:{args.port} · {args.workers} worker(s) · "
        f"{tokens} tokens per answer · {args.token_delay_ms} ms/token"
    )
    uvicorn.run(
        "bench.gateway_overhead.fixed_upstream:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
    )


if __name__ == "__main__":
    main()
