"""POST /v1/completions: text completions over the serving core, token-exact.

For agents that build their own prompts: the prompt is text (tokenized without special tokens, as
the gateway's chat prompts are) or token ids, given to the engine as they are, no chat template. A
session's call extends its latest call when that call's whole chain (prompt + sampled ids) is a prefix
of the new prompt, so a growing transcript is one trajectory, exactly as over chat. `return_token_ids`
(vLLM's extension) returns the prompt and sampled ids.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator

from tracetrain.engines.base import EngineError, SamplingParams
from tracetrain.proxy.auth import CallerDep
from tracetrain.proxy.binding import BindingId, bind
from tracetrain.proxy.errors import APIError, error_body, refusal
from tracetrain.proxy.event_stream import FLUSH, EventStream
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.openapi import generation_responses
from tracetrain.proxy.protocol import (
    INTEGRAL,
    SEED_MAX,
    SEED_MIN,
    Metadata,
    UnappliedPenalties,
    neutral_only,
)
from tracetrain.proxy.serving import (
    CallSpec,
    Choice,
    StreamRun,
    Turn,
    counted,
    generate_all,
    prepare,
    record,
    reply_message,
)

router = APIRouter()
GENERATING = generation_responses()


def _one_prompt(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list) for v in value):
            raise refusal("invalid_value", "One prompt per request: send each prompt as its own request (its own "
                          "session).") from None
        raise


TokenIds = Annotated[list[Annotated[int, Field(ge=0), INTEGRAL]], Field(min_length=1)]
"""Token ids of the served model (below its vocabulary size, which the gateway checks: the document cannot know it)."""
Text = Annotated[str, Field(min_length=1)]


class CompletionRequest(UnappliedPenalties):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 16}]})
    model: str
    prompt: Annotated[Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)], WrapValidator(_one_prompt)] = Field(description=(
            "One prompt: text, token ids, or a list of one of these (send each further prompt as its own request)."))
    max_tokens: Annotated[int, Field(ge=1, le=131072), INTEGRAL] = 16
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: Annotated[int, Field(ge=1, le=16), INTEGRAL] = 1
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), INTEGRAL] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    echo: Annotated[Literal[False], neutral_only("false", boolean=True)] = Field(default=False,
                                                                                  description="Not supported.")
    suffix: Annotated[Literal[""] | None, neutral_only("null")] = Field(default=None, description="Not supported.")
    stream: bool = False
    user: BindingId | None = None
    metadata: Metadata | None = None
    return_token_ids: bool = False


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    policy_version: int
    session_id: str
    prompt_token_ids: list[int] | None = None


def _prompt_ids(gw: Gateway, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    """The one prompt's ids (the model admits a list of one prompt only)."""
    first = prompt[0] if isinstance(prompt, list) and not isinstance(prompt[0], int) else prompt
    return gw.renderer.encode(first) if isinstance(first, str) else [int(t) for t in first]  # type: ignore[union-attr]


def _spec(gw: Gateway, request: Request, body: CompletionRequest) -> CallSpec:
    ids = _prompt_ids(gw, body.prompt)
    if not ids:
        raise APIError(400, "The prompt is empty.", code="invalid_value", param="prompt")
    vocab = gw.renderer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"Prompt token ids must be in [0, {vocab}).", code="invalid_value", param="prompt")
    params = SamplingParams(
        max_tokens=body.max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []), seed=body.seed,
        top_logprobs=body.logprobs or 0, structured_output=None, stream=body.stream,
    )
    sent = body.prompt if isinstance(body.prompt, str) else gw.renderer.tokenizer.decode(ids)
    return CallSpec(
        model=body.model, messages=[], tools=None, tools_enabled=False, params=params, constraint=None, n=body.n,
        binding=bind(request, metadata=body.metadata.model_dump(exclude_none=True) if body.metadata else None,
                     user=body.user), completion_id=f"cmpl-{uuid.uuid4().hex}",
        request_messages=[{"role": "prompt", "content": sent}], prompt_ids=ids,
        bypass_admission=request.headers.get("x-admission", "").lower() == "bypass",
    )


def _logprobs(gw: Gateway, choice: Choice, start: int, end: int) -> CompletionLogprobs:
    tops = choice.top_logprobs[start:end] if choice.top_logprobs else None
    return CompletionLogprobs(tokens=[gw.renderer.token_text(t) for t in choice.token_ids[start:end]],
                              token_logprobs=choice.logprobs[start:end], top_logprobs=tops)


def _usage(turn: Turn) -> CompletionUsage:
    completion = sum(len(c.token_ids) for c in turn.choices)
    return CompletionUsage(prompt_tokens=len(turn.plan.prompt_ids), completion_tokens=completion,
                           total_tokens=len(turn.plan.prompt_ids) + completion)


async def _complete(gw: Gateway, turn: Turn, body: CompletionRequest) -> CompletionResponse:
    await generate_all(gw, turn)
    return CompletionResponse(
        id=turn.spec.completion_id, created=int(time.time()), model=turn.spec.model, usage=_usage(turn),
        choices=[CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason or "stop",
                                  logprobs=_logprobs(gw, c, 0, len(c.token_ids)) if body.logprobs is not None else None,
                                  token_ids=c.token_ids if body.return_token_ids else None) for c in turn.choices],
        policy_version=turn.version, session_id=turn.session_id,
        prompt_token_ids=turn.plan.prompt_ids if body.return_token_ids else None,
    )


async def _stream(gw: Gateway, turn: Turn, run: StreamRun, body: CompletionRequest) -> AsyncIterator[bytes]:
    created = int(time.time())
    sent_tokens = [0] * len(turn.choices)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {"id": turn.spec.completion_id, "object": "text_completion", "created": created,
                   "model": turn.spec.model, "choices": choices, **extra}
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    running = len(turn.choices)
    try:
        while running:
            index, error, finished = await run.next()
            if error is not None:
                status, code = (error.status, error.code) if isinstance(error, EngineError) else (504, "timeout")
                yield b"data: " + orjson.dumps(error_body(status, str(error) or "timeout", code)) + b"\n\n"
                return
            running -= finished
            c = turn.choices[index]
            if len(c.text) > c.emitted:
                piece: dict[str, Any] = {"index": index, "text": c.text[c.emitted :], "finish_reason": None,
                                         "logprobs": None}
                if body.logprobs is not None:
                    piece["logprobs"] = _logprobs(gw, c, sent_tokens[index], len(c.token_ids)).model_dump()
                sent_tokens[index] = len(c.token_ids)
                c.emitted = len(c.text)
                yield chunk([piece])
    finally:
        run.cancel()
    yield FLUSH  # the text so far must not wait for the record
    await record(gw, turn, [reply_message(turn, c) for c in turn.choices])
    for c in turn.choices:
        yield chunk([{"index": c.index, "text": "", "finish_reason": c.finish_reason or "stop", "logprobs": None,
                      **({"token_ids": c.token_ids} if body.return_token_ids else {})}], policy_version=turn.version)
    gw.metrics.latency.labels("true").observe(time.perf_counter() - turn.started)
    yield b"data: [DONE]\n\n"


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATING)
@router.post("/s/{session}/v1/completions", response_model=CompletionResponse, responses=GENERATING)
@router.post("/s/{session}/g/{group}/v1/completions", response_model=CompletionResponse, responses=GENERATING)
async def completions(body: CompletionRequest, request: Request,
                      gw: GatewayDep, response: Response, caller: CallerDep) -> Any:
    async with counted(gw, body.stream):
        turn = await prepare(gw, _spec(gw, request, body), caller=caller)
        if body.stream:
            run = StreamRun(gw, turn)
            await run.started()
            return EventStream(_stream(gw, turn, run, body), ready=run.ready, headers=turn.headers())
        completion = await _complete(gw, turn, body)
    response.headers.update(turn.headers())
    return completion
