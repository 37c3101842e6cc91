"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages adapter over the serving core
(proxy/serving.py; a count over proxy/counting.py).

Agents on the Anthropic SDK point `ANTHROPIC_BASE_URL` at the gateway (`…/s/{session}` to bind a
session by path). Their messages become canonical chat messages, so a session's calls chain exactly as
over Chat Completions (a session may even mix the two); replies come back as `text` and `tool_use`
blocks, streamed with Anthropic's events; errors in Anthropic's shape (proxy/errors.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from tracetrain.engines.base import EngineError, SamplingParams
from tracetrain.proxy.auth import CallerDep
from tracetrain.proxy.binding import bind
from tracetrain.proxy.constraints import forced_call
from tracetrain.proxy.counting import prompt_ids
from tracetrain.proxy.errors import anthropic_error_body
from tracetrain.proxy.event_stream import FLUSH, EventStream
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.messages_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    Metadata,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    Usage,
    canonical_messages,
    chat_tools,
)
from tracetrain.proxy.openapi import error_responses, generation_responses
from tracetrain.proxy.partial_json import partial_object
from tracetrain.proxy.render import canonical_message, cut_call, first_tool_call_only, unread_call
from tracetrain.proxy.serving import (
    CallSpec,
    Choice,
    StreamRun,
    Turn,
    counted,
    generate,
    prepare,
    record,
    reply_message,
    text_pieces,
)

router = APIRouter()
GENERATING = generation_responses()


def _forced(body: CountTokensRequest) -> str | None:
    """Anthropic's tool_choice in the core's terms: `any` is `required`, `tool` names one."""
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceAny):
        return "required"
    return choice.name if isinstance(choice, ToolChoiceTool) else None


def _spec(request: Request, body: CountTokensRequest, params: SamplingParams, metadata: Metadata | None) -> CallSpec:
    """The core's call for a Messages request, or for a count of its prompt (which has no sampling or metadata)."""
    constraint = forced_call({t.name: t.input_schema for t in body.tools or []}, _forced(body))
    params.structured_output = constraint.structured_output if constraint else None
    sent = [m.model_dump(exclude_none=True) for m in body.messages]
    if body.system:
        sent.insert(0, {"role": "system", "content": body.system if isinstance(body.system, str)
                        else [b.model_dump() for b in body.system]})
    return CallSpec(
        model=body.model, messages=[canonical_message(m) for m in canonical_messages(body)],
        tools=chat_tools(body.tools), tools_enabled=not isinstance(body.tool_choice, ToolChoiceNone),
        params=params, constraint=constraint, n=1,
        binding=bind(request, metadata=metadata.model_dump(exclude_none=True) if metadata else None,
                     user=metadata.user_id if metadata else None),
        completion_id=f"msg_{uuid.uuid4().hex}", request_messages=sent,
        bypass_admission=request.headers.get("x-admission", "").lower() == "bypass",
    )


def _sampling(body: MessagesRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=body.max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, stop=list(body.stop_sequences or []), seed=None,
        top_logprobs=0, stream=body.stream)


def _one_call(body: MessagesRequest) -> bool:
    """`disable_parallel_tool_use`: at most one tool_use block in the reply (vLLM's reading, its first call)."""
    choice = body.tool_choice
    return (isinstance(choice, ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool)
            and bool(choice.disable_parallel_tool_use))


def _reply(turn: Turn, body: MessagesRequest) -> dict[str, Any]:
    reply = reply_message(turn, turn.choices[0])
    return first_tool_call_only(reply) if _one_call(body) else reply


def _blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply["content"]}] if reply.get("content") else []
    for call in reply.get("tool_calls") or []:
        # `input` must be an object: arguments cut short or not JSON give what of them can be read.
        arguments = call["function"]["arguments"]
        value = partial_object(arguments) if unread_call(call["id"]) else json.loads(arguments)
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": value if isinstance(value, dict) else {"value": value}})
    return blocks


def _stop(gw: Gateway, turn: Turn, choice: Choice, reply: dict[str, Any]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A stop that did not end on the turn-end token was a stop
    sequence; which one is named only when there was one (the engine does not say). A tool_use block cut
    short by the token limit makes it `max_tokens`."""
    calls = reply.get("tool_calls") or []
    if calls and not any(cut_call(call) for call in calls):
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    stops = turn.spec.params.stop
    if stops and not (choice.token_ids and choice.token_ids[-1] == gw.renderer.turn_end_id):
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return "end_turn", None


def _usage(turn: Turn) -> Usage:
    return Usage(input_tokens=len(turn.plan.prompt_ids), output_tokens=sum(len(c.token_ids) for c in turn.choices))


async def _complete(gw: Gateway, turn: Turn, body: MessagesRequest) -> MessageResponse:
    await generate(gw, turn, turn.choices[0])
    reply = _reply(turn, body)
    await record(gw, turn, [reply])
    reason, sequence = _stop(gw, turn, turn.choices[0], reply)
    return MessageResponse(id=turn.spec.completion_id, model=turn.spec.model, content=_blocks(reply),
                           stop_reason=reason, stop_sequence=sequence, usage=_usage(turn))  # type: ignore[arg-type]


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


async def _stream(gw: Gateway, turn: Turn, run: StreamRun, body: MessagesRequest) -> AsyncIterator[bytes]:
    choice = turn.choices[0]
    message: dict[str, Any] = {
        "id": turn.spec.completion_id, "type": "message", "role": "assistant", "model": turn.spec.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(turn.plan.prompt_ids), "output_tokens": 0}}
    yield _event("message_start", {"message": message})
    text_open = False

    def text(piece: str) -> list[bytes]:
        nonlocal text_open
        events = [] if text_open else [_event("content_block_start",
                                               {"index": 0, "content_block": {"type": "text", "text": ""}})]
        text_open = True
        return [*events, _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})]

    try:
        async for piece in text_pieces(turn, run):
            for event in text(piece):
                yield event
    except Exception as error:
        status = error.status if isinstance(error, EngineError) else 504
        yield _event("error", {"error": anthropic_error_body(status, str(error) or "timeout")["error"]})
        return
    yield FLUSH  # the text so far must not wait for the record
    reply = _reply(turn, body)
    await record(gw, turn, [reply])
    rest = (reply.get("content") or "")[choice.emitted :]  # text held back as a possible tool call
    for event in text(rest) if rest else []:
        yield event
    index = 0
    if text_open:
        yield _event("content_block_stop", {"index": 0})
        index = 1
    for block in _blocks(reply):
        if block["type"] != "tool_use":
            continue
        yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
        yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                       "partial_json": json.dumps(block["input"])}})
        yield _event("content_block_stop", {"index": index})
        index += 1
    reason, sequence = _stop(gw, turn, choice, reply)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": len(choice.token_ids)}})
    yield _event("message_stop", {})
    gw.metrics.latency.labels("true").observe(time.perf_counter() - turn.started)


@router.post("/v1/messages", response_model=MessageResponse, responses=GENERATING)
@router.post("/s/{session}/v1/messages", response_model=MessageResponse, responses=GENERATING)
@router.post("/s/{session}/g/{group}/v1/messages", response_model=MessageResponse, responses=GENERATING)
async def messages(body: MessagesRequest, request: Request,
                   gw: GatewayDep, response: Response, caller: CallerDep) -> Any:
    async with counted(gw, body.stream):
        turn = await prepare(gw, _spec(request, body, _sampling(body), body.metadata), caller=caller)
        if body.stream:
            run = StreamRun(gw, turn)
            await run.started()
            return EventStream(_stream(gw, turn, run, body), ready=run.ready, headers=turn.headers(),
                               on_drop=run.dropped)
        message = await _complete(gw, turn, body)
    response.headers.update(turn.headers())
    return message


COUNTING = error_responses(401, 403, 404, described={403: "The session belongs to another API key",
                                                     404: "No such model"})


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=COUNTING)
@router.post("/s/{session}/v1/messages/count_tokens", response_model=CountTokensResponse, responses=COUNTING)
@router.post("/s/{session}/g/{group}/v1/messages/count_tokens", response_model=CountTokensResponse,
             responses=COUNTING)
async def count_tokens(body: CountTokensRequest, request: Request,
                       gw: GatewayDep, caller: CallerDep) -> CountTokensResponse:
    """The prompt's tokens as a Messages call with these fields would send them (`input_tokens` of its usage),
    rendered by the gateway itself; under a session path, on the session's token chain. Records nothing."""
    spec = _spec(request, body, SamplingParams(), None)
    ids = await prompt_ids(gw, spec, caller=caller)
    return CountTokensResponse(input_tokens=len(ids))
