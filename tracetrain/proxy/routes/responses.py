"""POST /v1/responses and GET /v1/responses/{id}: the OpenAI Responses adapter over the serving core.

The gateway keeps the conversation: a request with `previous_response_id` continues that response's
conversation (its input and output, `instructions` excepted, as OpenAI does) in the same session, so
the chained requests are one token-exact trajectory. `store: false` responses are still recorded for
training but cannot be read back or continued.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Path, Request, Response
from pydantic import BaseModel, ConfigDict

from tracetrain.engines.base import EngineError, SamplingParams
from tracetrain.proxy.auth import Caller, CallerDep
from tracetrain.proxy.binding import Binding, bind
from tracetrain.proxy.constraints import Constraint, forced_call, json_output
from tracetrain.proxy.errors import APIError, error_body
from tracetrain.proxy.event_stream import FLUSH, EventStream
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.openapi import error_responses, generation_responses
from tracetrain.proxy.render import canonical_message
from tracetrain.proxy.responses_protocol import (
    INSTRUCTIONS,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    chat_tools,
    input_messages,
    output_items,
)
from tracetrain.proxy.serving import (
    CallSpec,
    StreamRun,
    Turn,
    counted,
    finish_reason,
    finish_stream,
    generate_all,
    prepare,
    text_pieces,
)
from tracetrain.proxy.session_directory import forbidden_policy
from tracetrain.store import queries
from tracetrain.store.messages import call_messages
from tracetrain.store.models import PURGED_STATE, Call

router = APIRouter()
GENERATING = generation_responses({404: "No such model or previous response"})
STORED = error_responses(401, 403, 404, described={403: "The response belongs to another API key",
                                                  404: "No such response"})


class ResponseObject(BaseModel):
    """The Responses API's response object (the fields the SDK reads; extra ones pass through)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any]


async def _stored(gw: Gateway, response_id: str, caller: Caller, param: str | None) -> Call:
    """The recorded call of a stored response the caller may read."""
    calls = await gw.read(lambda db: queries.calls_by_completion(db, completion_id=response_id))
    call = calls[0] if calls else None
    # A purged call's content is gone (store/retention.py): nothing to read back or continue from.
    if call is None or call.request_params.get("store") is False or call.state_hash == PURGED_STATE:
        raise APIError(404, f"Response '{response_id}' not found.", code="response_not_found", param=param)
    session = await gw.sessions.lookup(call.session_id)
    if session is not None and caller.confined_elsewhere(session.policy):
        raise forbidden_policy(call.session_id, session.policy, caller.policy)
    if not caller.may_access(call.owner):
        raise APIError(403, f"Response '{response_id}' belongs to another API key.", code="session_forbidden")
    return call


def _metadata(body: ResponsesRequest | None) -> dict[str, Any] | None:
    return body.metadata.model_dump(exclude_none=True) if body and body.metadata else None


def _constraint(body: ResponsesRequest) -> Constraint | None:
    choice = body.tool_choice
    name = choice if isinstance(choice, str) or choice is None else choice.name
    forced = forced_call({t.name: t.parameters for t in body.tools or [] if t.name}, name)
    if forced is not None:
        return forced
    form = body.text.format if body.text else None
    if isinstance(form, TextFormatJSONObject):
        return json_output(None)
    if isinstance(form, TextFormatJSONSchema):
        return json_output(form.schema_)
    return None


async def _spec(gw: Gateway, request: Request, body: ResponsesRequest, caller: Caller) -> CallSpec:
    history: list[dict[str, Any]] = []
    binding = bind(request, metadata=_metadata(body), user=body.user)
    if body.previous_response_id:
        previous = await _stored(gw, body.previous_response_id, caller, "previous_response_id")
        if binding.session_id not in (None, previous.session_id):
            raise APIError(400, f"previous_response_id belongs to session '{previous.session_id}', not "
                           f"'{binding.session_id}'.", code="session_mismatch", param="previous_response_id")
        binding = Binding(previous.session_id, binding.group_id, binding.retry, binding.train)
        sent = await gw.read(lambda db: call_messages(db, call=previous))
        history = [m for m in sent if m.get("source") != INSTRUCTIONS] + [previous.response_message]
    known = {c["id"] for m in history for c in m.get("tool_calls") or []}
    conversation = history + input_messages(body.input, known)
    if body.instructions:
        conversation.insert(0, {"role": "system", "content": body.instructions, "source": INSTRUCTIONS})
    constraint = _constraint(body)
    params = SamplingParams(
        max_tokens=body.max_output_tokens or gw.config.gateway.default_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, stop=[], seed=None, top_logprobs=0,
        structured_output=constraint.structured_output if constraint else None, stream=body.stream,
    )
    return CallSpec(
        model=body.model, messages=[canonical_message(m) for m in conversation], tools=chat_tools(body.tools),
        tools_enabled=body.tool_choice != "none", params=params, constraint=constraint, n=1, binding=binding,
        completion_id=f"resp_{uuid.uuid4().hex}", request_messages=conversation,
        bypass_admission=request.headers.get("x-admission", "").lower() == "bypass",
        record_params={"store": body.store},  # a store=false response is not read back or continued
    )


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


def _shell(response_id: str, model: str, created: int, status: str, body: ResponsesRequest | None,
           previous: str | None) -> dict[str, Any]:
    """The response object's fields besides output and usage."""
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions if body else None, "metadata": _metadata(body) or {},
            "parallel_tool_calls": False, "previous_response_id": previous,
            "temperature": body.temperature if body else None, "top_p": body.top_p if body else None,
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) else "auto") if body else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []] if body else [],
            "max_output_tokens": body.max_output_tokens if body else None, "store": body.store if body else True,
            "text": {"format": {"type": "text"}}, "truncation": "disabled"}


def _status(finish: str | None) -> str:
    """The response's status from the call's finish reason as Chat Completions gives it (serving.finish_reason,
    also what the call records): `incomplete` when the limit cut the output, its text or a call (`length`).
    A length stop after whole calls (the limit took the turn end, or text after the calls, which no item
    holds) is `completed`: no item of the output is cut, and the other APIs say `tool_calls` and `tool_use`
    there. OpenAI documents `incomplete` with `incomplete_details.reason: max_output_tokens` for output the
    limit cut short, and nothing for a limit reached after complete output: the status follows the output."""
    return "incomplete" if finish == "length" else "completed"


def _from_turn(turn: Turn, reply: dict[str, Any], body: ResponsesRequest, created: int) -> ResponseObject:
    choice = turn.choices[0]
    status = _status(finish_reason(choice, reply))
    return ResponseObject(**{**_shell(turn.spec.completion_id, turn.spec.model, created, status, body,
                                      body.previous_response_id),
                             "output": output_items(reply, turn.spec.completion_id, status),
                             "usage": _usage(len(turn.plan.prompt_ids), len(choice.token_ids))})


def _event(kind: str, sequence: list[int], payload: dict[str, Any]) -> bytes:
    sequence[0] += 1
    data = orjson.dumps({"type": kind, "sequence_number": sequence[0] - 1, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def _stream(gw: Gateway, turn: Turn, run: StreamRun, body: ResponsesRequest) -> AsyncIterator[bytes]:
    created, seq = int(time.time()), [0]
    shell = _shell(turn.spec.completion_id, turn.spec.model, created, "in_progress", body, body.previous_response_id)
    yield _event("response.created", seq, {"response": {**shell, "output": [], "usage": None}})
    message_id = f"msg_{turn.spec.completion_id.removeprefix('resp_')}"
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    opened = False

    def text(piece: str) -> list[bytes]:
        nonlocal opened
        events = []
        if not opened:
            opened = True
            item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}
            events += [_event("response.output_item.added", seq, {"output_index": 0, "item": item}),
                       _event("response.content_part.added", seq, {**where, "part": {
                           "type": "output_text", "text": "", "annotations": []}})]
        return [*events, _event("response.output_text.delta", seq, {**where, "delta": piece, "logprobs": []})]

    try:
        async for piece in text_pieces(turn, run):
            for event in text(piece):
                yield event
    except Exception as error:
        status, code = (error.status, error.code) if isinstance(error, EngineError) else (504, "timeout")
        failure = error_body(status, str(error) or "timeout", code)["error"]
        yield _event("error", seq, {"code": failure["code"], "message": failure["message"], "param": None})
        return
    yield FLUSH  # the text so far must not wait for the record
    reply, rest = await finish_stream(gw, turn)
    for event in text(rest) if rest else []:
        yield event
    final = _from_turn(turn, reply, body, created).model_dump()
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield _event("response.output_text.done", seq, {**where, "text": part["text"], "logprobs": []})
            yield _event("response.content_part.done", seq, {**where, "part": part})
        else:
            at = {"item_id": item["id"], "output_index": index}
            yield _event("response.output_item.added", seq, {"output_index": index, "item": {
                **item, "arguments": "", "status": "in_progress"}})
            yield _event("response.function_call_arguments.delta", seq, {**at, "delta": item["arguments"]})
            yield _event("response.function_call_arguments.done", seq, {**at, "arguments": item["arguments"],
                                                                         "name": item["name"]})
        yield _event("response.output_item.done", seq, {"output_index": index, "item": item})
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield _event(kind, seq, {"response": final})
    gw.metrics.latency.labels("true").observe(time.perf_counter() - turn.started)


@router.post("/v1/responses", response_model=ResponseObject, responses=GENERATING)
@router.post("/s/{session}/v1/responses", response_model=ResponseObject, responses=GENERATING)
@router.post("/s/{session}/g/{group}/v1/responses", response_model=ResponseObject, responses=GENERATING)
async def create_response(body: ResponsesRequest, request: Request,
                          gw: GatewayDep, response: Response, caller: CallerDep) -> Any:
    async with counted(gw, body.stream):
        turn = await prepare(gw, await _spec(gw, request, body, caller), caller=caller)
        if body.stream:
            run = StreamRun(gw, turn)
            await run.started()
            return EventStream(_stream(gw, turn, run, body), ready=run.ready, headers=turn.headers(),
                               on_drop=run.dropped)
        (reply,) = await generate_all(gw, turn)
        created = _from_turn(turn, reply, body, int(time.time()))
    response.headers.update(turn.headers())
    return created


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=STORED)
@router.get("/s/{session}/v1/responses/{response_id}", response_model=ResponseObject, responses=STORED)
@router.get("/s/{session}/g/{group}/v1/responses/{response_id}", response_model=ResponseObject, responses=STORED)
async def get_response(gw: GatewayDep, caller: CallerDep, response_id: str = Path()) -> ResponseObject:
    call = await _stored(gw, response_id, caller, None)
    status = _status(call.finish_reason)
    return ResponseObject(**{**_shell(call.completion_id, call.model, int(call.created_at.timestamp()),
                                      status, None, None),
                             "output": output_items(call.response_message, call.completion_id, status),
                             "usage": _usage(call.prompt_tokens, call.completion_tokens)})
