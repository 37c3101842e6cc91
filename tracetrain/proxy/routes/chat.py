"""POST /v1/chat/completions: the Chat Completions adapter over the serving core (proxy/serving.py).

It turns the request into the core's `CallSpec` and the core's choices into OpenAI's response or
stream chunks; binding, chaining, generating and recording are the core's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from tracetrain.engines.base import EngineError, SamplingParams
from tracetrain.proxy.auth import CallerDep
from tracetrain.proxy.binding import bind
from tracetrain.proxy.constraints import Constraint, forced_call, json_output
from tracetrain.proxy.errors import STORE_ERRORS, APIError, error_body, store_error
from tracetrain.proxy.event_stream import FLUSH, EventStream
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.openapi import generation_responses
from tracetrain.proxy.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    TokenLogprob,
    TopLogprob,
    Usage,
    message_problem,
)
from tracetrain.proxy.render import canonical_message, first_tool_call_only
from tracetrain.proxy.serving import (
    CallSpec,
    Choice,
    StreamRun,
    Turn,
    counted,
    finish_reason,
    generate,
    prepare,
    record,
    reply_message,
)

router = APIRouter()
GENERATING = generation_responses()


def _constraint(body: ChatCompletionRequest) -> Constraint | None:
    """A forced tool call wins over `response_format`."""
    choice = body.tool_choice
    name = choice if isinstance(choice, str) or choice is None else choice.function.name
    forced = forced_call(body.functions(), name)
    if forced is not None:
        return forced
    if isinstance(body.response_format, JSONObjectFormat):
        return json_output(None)
    if isinstance(body.response_format, JSONSchemaResponseFormat):
        return json_output(body.response_format.json_schema.json_schema)
    return None


def _spec(request: Request, body: ChatCompletionRequest, default_max_tokens: int) -> CallSpec:
    if problem := message_problem(body.messages):
        param, message, code = problem
        raise APIError(400, message, code=code, param=param)
    constraint = _constraint(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(
        max_tokens=body.max_completion_tokens or body.max_tokens or default_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=stop, seed=body.seed, top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        structured_output=constraint.structured_output if constraint else None, stream=body.stream,
    )
    sent = [m.model_dump(exclude_none=True) for m in body.messages]
    metadata = body.metadata.model_dump(exclude_none=True) if body.metadata else None
    return CallSpec(
        model=body.model, messages=[canonical_message(m) for m in sent],
        tools=[t.as_sent for t in body.tools] if body.tools else None, tools_enabled=body.tool_choice != "none",
        params=params, constraint=constraint, n=body.n, binding=bind(request, metadata=metadata, user=body.user),
        completion_id=f"chatcmpl-{uuid.uuid4().hex}",
        request_messages=sent,
        bypass_admission=request.headers.get("x-admission", "").lower() == "bypass",
    )


def _logprobs(gw: Gateway, choice: Choice, start: int, end: int) -> ChoiceLogprobs:
    content = []
    for i in range(start, end):
        token = gw.renderer.token_text(choice.token_ids[i])
        tops = choice.top_logprobs[i] if i < len(choice.top_logprobs) else {}
        content.append(TokenLogprob(
            token=token, logprob=choice.logprobs[i], bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in tops.items()]))
    return ChoiceLogprobs(content=content)


def _usage(turn: Turn) -> Usage:
    completion = sum(len(c.token_ids) for c in turn.choices)
    prompt = len(turn.plan.prompt_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _replies(turn: Turn, body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The finished choices as assistant messages; with `parallel_tool_calls: false`, each with its first tool call
    only, as vLLM answers. The record keeps every sampled token and this reply, so the client's next request, which
    sends the reply back, still extends the call's token chain."""
    replies = [reply_message(turn, c) for c in turn.choices]
    return [first_tool_call_only(r) for r in replies] if body.parallel_tool_calls is False else replies


async def _complete(gw: Gateway, turn: Turn, body: ChatCompletionRequest) -> ChatCompletionResponse:
    await asyncio.gather(*(generate(gw, turn, c) for c in turn.choices))
    replies = _replies(turn, body)
    await record(gw, turn, replies)
    logprobs = body.logprobs
    return ChatCompletionResponse(
        id=turn.spec.completion_id, created=int(time.time()), model=turn.spec.model,
        choices=[ChatCompletionChoice(index=c.index, message=reply, finish_reason=finish_reason(c, reply),
                                      logprobs=_logprobs(gw, c, 0, len(c.token_ids)) if logprobs else None)
                 for c, reply in zip(turn.choices, replies, strict=True)],
        usage=_usage(turn), policy_version=turn.version, session_id=turn.session_id,
    )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _stream(gw: Gateway, turn: Turn, run: StreamRun, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
    created = int(time.time())
    tools_on = turn.spec.tools_enabled and bool(turn.spec.tools)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _sse({"id": turn.spec.completion_id, "object": "chat.completion.chunk", "created": created,
                     "model": turn.spec.model, "choices": choices, **extra})

    for c in turn.choices:
        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    sent_tokens = [0] * len(turn.choices)
    running = len(turn.choices)
    try:
        while running:
            index, error, finished = await run.next()
            if error is not None:
                run.cancel()
                status, code = (error.status, error.code) if isinstance(error, EngineError) else (504, "timeout")
                yield _sse(error_body(status, str(error) or "The engine did not answer in time.", code))
                return
            running -= finished
            c = turn.choices[index]
            visible = c.visible_text(tools_on)
            if len(visible) > c.emitted:
                piece: dict[str, Any] = {"index": index, "delta": {"content": visible[c.emitted :]},
                                         "finish_reason": None}
                if body.logprobs:
                    piece["logprobs"] = _logprobs(gw, c, sent_tokens[index], len(c.token_ids)).model_dump()
                    sent_tokens[index] = len(c.token_ids)
                c.emitted = len(visible)
                yield chunk([piece])
    finally:
        run.cancel()
    replies = _replies(turn, body)
    yield FLUSH  # the text so far must not wait for the record
    try:
        await record(gw, turn, replies)
    except STORE_ERRORS as exc:  # not recorded, so no final chunk: an error event instead of a cut stream
        error = store_error(exc)
        yield _sse(error_body(error.status, error.message, error.code))
        return
    for c, reply in zip(turn.choices, replies, strict=True):
        delta: dict[str, Any] = {}
        if reply.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(reply["tool_calls"])]
        elif len(reply.get("content") or "") > c.emitted:
            delta["content"] = reply["content"][c.emitted :]
        yield chunk([{"index": c.index, "delta": delta, "finish_reason": finish_reason(c, reply)}],
                    policy_version=turn.version)
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], usage=_usage(turn).model_dump())
    gw.metrics.latency.labels("true").observe(time.perf_counter() - turn.started)
    yield b"data: [DONE]\n\n"


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATING)
@router.post("/s/{session}/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATING)
@router.post("/s/{session}/g/{group}/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATING)
async def chat_completions(body: ChatCompletionRequest, request: Request, gw: GatewayDep, response: Response,
                           caller: CallerDep) -> Any:
    async with counted(gw, body.stream):
        turn = await prepare(gw, _spec(request, body, gw.config.gateway.default_max_tokens), caller=caller)
        if body.stream:
            run = StreamRun(gw, turn)
            await run.started()
            return EventStream(_stream(gw, turn, run, body), ready=run.ready, headers=turn.headers(),
                               on_drop=run.dropped)
        completion = await _complete(gw, turn, body)
    response.headers.update(turn.headers())
    return completion
