"""A GPU upstream that speaks the vLLM dialect the gateway uses, generating with transformers.

Why it exists: a machine with a GPU but no vLLM (no package registry to install it from) can still
measure what the gateway adds in front of an engine that really generates on the GPU. Generation
runs in transformers' continuous-batching manager (paged attention, requests joining and leaving the
batch at every step), so many concurrent requests share each forward pass as they do in vLLM. It is
not vLLM: its scheduler, kernels and per-step Python overhead differ, so its own req/s says nothing
about vLLM's. What it gives is the same answer to the gateway and to the direct client, so that the
gateway's added latency and throughput loss can be read off side by side.

- `POST /v1/completions` with `prompt` as token ids, streamed or not: `token_ids`, `logprobs.token_logprobs`
  (the sampled token's; `top_logprobs` holds only the sampled token), `prompt_token_ids` echoed.
- `POST /v1/chat/completions`, streamed or not: the chat template applied here, as vLLM does; the
  "direct" baseline of `bench.gateway_overhead`.
- `GET /health`: 200.

Every answer is exactly `max_tokens` long (end of sequence ignored), greedy, so both paths do the same
work. `--random-weights` builds the model from the directory's config with random weights: the same
computation per token as the trained weights, for a machine the weights cannot be copied to.

    python -m bench.torch_upstream --model DIR --port 8200 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from bench.fixed_upstream import (
    FINAL_TAIL,
    FINGERPRINT,
    TAIL,
    Receive,
    Scope,
    Send,
    _head,
    _respond,
    _send_more,
    _start_stream,
    _usage,
    generation_request,
)


class Generator:
    """transformers' continuous batching behind an async call: one request in, its tokens out."""

    def __init__(self, model_dir: Path, device: str, dtype: str, random_weights: bool, max_batch_tokens: int) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        torch_dtype = getattr(torch, dtype)
        if random_weights:
            config = AutoConfig.from_pretrained(str(model_dir))
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="paged|sdpa")
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch_dtype, attn_implementation="paged|sdpa"
            )
        self.model = model.to(device).eval()
        # eos -1: no end of sequence, every answer runs to max_tokens (the same work on both paths).
        generation = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=-1)
        batching = ContinuousBatchingConfig(return_logprobs=True, max_batch_tokens=max_batch_tokens)
        self.manager = self.model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=batching
        )
        self.manager.start()

    async def generate(self, prompt: list[int], max_tokens: int, stream: bool) -> asyncio.Queue[Any]:
        """A queue of the request's outputs (cumulative tokens and logprobs), the last one finished."""
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        request_id = f"r-{uuid.uuid4().hex}"
        # Registered before the request is added: a fast engine could otherwise answer before the handler.
        self.manager.register_result_handler(request_id, outputs.put_nowait)
        self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens, streaming=stream,
                                 eos_token_id=-1)
        return outputs

    def pieces(self, token_ids: list[int], start: int) -> list[str]:
        """The text each of `token_ids[start:]` adds (decoding the whole prefix, as detokenizers do)."""
        out: list[str] = []
        prev = str(self.tokenizer.decode(token_ids[:start]))
        for i in range(start, len(token_ids)):
            text = str(self.tokenizer.decode(token_ids[: i + 1]))
            out.append(text[len(prev):])
            prev = text
        return out

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=10)


def _logprobs(tokens: list[str], logprobs: list[float], offset: int) -> dict[str, Any]:
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]}


class TorchUpstream:
    """The ASGI app."""

    def __init__(self, generator: Generator) -> None:
        self.gen = generator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = await generation_request(scope, receive, send)
        if request is None:
            return
        path, body = request
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if path == "/v1/completions":
            await self.completions(body, n, send)
        else:
            await self.chat(body, n, send)

    async def completions(self, body: dict[str, Any], n: int, send: Send) -> None:
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            await _respond(send, 400, b'{"error":{"message":"prompt must be a list of token ids","code":400}}')
            return
        ids = bool(body.get("return_token_ids"))
        want_logprobs = body.get("logprobs") is not None
        request_id, created, model = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time()), body.get("model", "torch")
        outputs = await self.gen.generate(prompt, n, bool(body.get("stream")))
        if not body.get("stream"):
            out = await _last(outputs)
            tokens = out.generated_tokens
            pieces = self.gen.pieces(tokens, 0)
            choice = {"index": 0, "text": "".join(pieces),
                      "logprobs": _logprobs(pieces, out.logprobs, 0) if want_logprobs else None,
                      "finish_reason": "length", "stop_reason": None, "token_ids": tokens if ids else None,
                      "prompt_logprobs": None, "prompt_token_ids": prompt if ids else None}
            payload = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice], "system_fingerprint": FINGERPRINT, "usage": _usage(len(prompt), n)}
            await _respond(send, 200, orjson.dumps(payload))
            return
        head = _head(request_id, "text_completion", created, model)
        await _start_stream(send)
        sent, offset = 0, 0
        while True:
            out = await outputs.get()
            tokens = out.generated_tokens
            if len(tokens) > sent:
                pieces = self.gen.pieces(tokens, sent)
                finished = out.is_finished()
                choice = {"index": 0, "text": "".join(pieces),
                          "logprobs": _logprobs(pieces, out.logprobs[sent:], offset) if want_logprobs else None,
                          "finish_reason": "length" if finished else None, "stop_reason": None,
                          "token_ids": tokens[sent:] if ids else None}
                if sent == 0:
                    choice["prompt_token_ids"] = prompt if ids else None
                offset += sum(len(p) for p in pieces)
                sent = len(tokens)
                await _send_more(send, head + orjson.dumps(choice) + (FINAL_TAIL if finished else TAIL))
            if out.is_finished():
                break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def chat(self, body: dict[str, Any], n: int, send: Send) -> None:
        request_id, created, model = f"chatcmpl-{uuid.uuid4().hex[:16]}", int(time.time()), body.get("model", "torch")
        prompt = list(self.gen.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                             tokenize=True, return_dict=False))
        stream = bool(body.get("stream"))
        outputs = await self.gen.generate(prompt, n, stream)
        if not stream:
            out = await _last(outputs)
            text = "".join(self.gen.pieces(out.generated_tokens, 0))
            payload = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                       "system_fingerprint": FINGERPRINT, "usage": _usage(len(prompt), n)}
            await _respond(send, 200, orjson.dumps(payload))
            return
        head = _head(request_id, "chat.completion.chunk", created, model)
        await _start_stream(send)
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        await _send_more(send, head + orjson.dumps(role) + TAIL)
        sent = 0
        while True:
            out = await outputs.get()
            tokens = out.generated_tokens
            if len(tokens) > sent:
                finished = out.is_finished()
                text = "".join(self.gen.pieces(tokens, sent))
                choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                          "finish_reason": "length" if finished else None}
                sent = len(tokens)
                await _send_more(send, head + orjson.dumps(choice) + (FINAL_TAIL if finished else TAIL))
            if out.is_finished():
                break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _last(outputs: asyncio.Queue[Any]) -> Any:
    while True:
        out = await outputs.get()
        if out.is_finished():
            return out


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from rich.console import Console

    parser = argparse.ArgumentParser(prog="python -m bench.torch_upstream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="model directory (tokenizer and config)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--random-weights", action="store_true", help="random weights from the config")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per forward pass")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    generator = Generator(args.model, args.device, args.dtype, args.random_weights, args.max_batch_tokens)
    Console(stderr=True).print(
        f"[bold]torch upstream[/] on http://{args.host}:{args.port} · {args.device} {args.dtype} · "
        f"{'random' if args.random_weights else 'trained'} weights · ready in {time.perf_counter() - started:.0f} s"
    )
    try:
        uvicorn.run(TorchUpstream(generator), host=args.host, port=args.port, log_level="warning",
                    access_log=False, timeout_keep_alive=30)
    finally:
        generator.stop()


if __name__ == "__main__":
    main()
