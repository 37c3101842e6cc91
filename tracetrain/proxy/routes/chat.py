"""POST /v1/chat/completions: bind, chain, generate, record, answer.

The answer (the last chunk of a stream) leaves only after the call is committed to the store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy import insert, update
from sqlmodel import Session, col

from tracetrain.engines.base import EngineError, SamplingParams
from tracetrain.proxy.auth import CallerDep
from tracetrain.proxy.binding import bind, prompt_group
from tracetrain.proxy.chain import ChainNode, PromptPlan, plan_prompt
from tracetrain.proxy.constraints import Constraint, plan_constraint
from tracetrain.proxy.errors import APIError, error_body
from tracetrain.proxy.gateway import Gateway
from tracetrain.proxy.protocol import ChatCompletionRequest
from tracetrain.proxy.render import TOOL_CALL_OPEN, canonical_message, history_hashes, parse_forced_call, parse_reply
from tracetrain.store import queries
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.models import CHAINED_LINKS, AgentSession, Call, utcnow

router = APIRouter()


@dataclass
class Choice:
    """One sampled choice as it accumulates."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    finish_reason: str | None = None
    version: int | None = None
    forced_prefix: str = ""
    """The tool-call opener put in the prompt for a forced call: the sampled text continues it."""

    def visible_text(self, tools_enabled: bool) -> str:
        """Text safe to stream now: with tools on, hold back anything that may open a tool call."""
        if self.forced_prefix:
            return ""
        if not tools_enabled:
            return self.text
        start = self.text.find(TOOL_CALL_OPEN)
        if start >= 0:
            return self.text[:start]
        for k in range(len(TOOL_CALL_OPEN) - 1, 0, -1):
            if self.text.endswith(TOOL_CALL_OPEN[:k]):
                return self.text[:-k]
        return self.text


@dataclass
class Turn:
    """Everything about one request that recording it needs."""

    completion_id: str
    session_id: str
    group_id: str
    new_session: bool
    owner: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    plan: PromptPlan
    parent: ChainNode | None
    params: SamplingParams
    version: int
    started: float
    request: ChatCompletionRequest
    choices: list[Choice]


def _sampling(body: ChatCompletionRequest, default_max_tokens: int, constraint: Constraint | None,
              ) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        max_tokens=body.max_completion_tokens or body.max_tokens or default_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=stop,
        seed=body.seed,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        structured_output=constraint.structured_output if constraint else None,
        stream=body.stream,
    )


async def _prepare(gw: Gateway, request: Request, body: ChatCompletionRequest, owner: str | None,
                   admin: bool) -> Turn:
    gw.check_model(body.model)
    binding = bind(request, body)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    messages = [canonical_message(m.model_dump(exclude_none=True)) for m in body.messages]
    tools = body.tools or None
    constraint = plan_constraint(tools=tools, tool_choice=body.tool_choice, response_format=body.response_format)
    session_id = binding.session_id or completion_id
    stored = await gw.session_info(session_id) if binding.session_id else None
    if stored is not None and not (admin or stored.owner == owner):
        raise APIError(403, f"Session '{session_id}' belongs to another API key.", code="session_forbidden")
    group_id = binding.group_id or (stored.group_id if stored else prompt_group(messages))
    if stored is None:
        # Siblings are admitted together only in groups the agent named; a prompt-hash group can be
        # every session of an agent that asks the same thing.
        await gw.admission.admit(session_id, binding.group_id,
                                 bypass=request.headers.get("x-admission", "").lower() == "bypass")
    else:
        gw.admission.touch(session_id)
    parent = None
    if stored is not None:
        parent = await gw.find_parent(session_id, history_hashes(tools, messages), messages)
    plan = plan_prompt(gw.renderer, messages=messages, tools=tools, parent=parent,
                       session_has_calls=stored is not None)
    if plan.parent_id is None and stored is not None:
        plan.parent_id = await gw.read(lambda db: queries.latest_call_id(db, session_id=session_id))
    forced = constraint.forced_prefix if constraint else ""
    if forced:
        plan.prompt_ids = plan.prompt_ids + gw.renderer.encode(forced)
    return Turn(
        completion_id=completion_id, session_id=session_id, group_id=group_id, new_session=stored is None,
        owner=stored.owner if stored else owner, messages=messages, tools=tools, plan=plan, parent=parent,
        params=_sampling(body, gw.config.default_max_tokens, constraint), version=gw.engine.version,
        started=time.perf_counter(), request=body, choices=[Choice(i, forced_prefix=forced) for i in range(body.n)],
    )


async def _generate(gw: Gateway, turn: Turn, choice: Choice, on_delta: Callable[[], None] | None = None) -> None:
    await gw.gate.wait()
    turn.version = gw.engine.version
    params = turn.params
    if params.seed is not None and choice.index:
        params = SamplingParams(**{**params.__dict__, "seed": params.seed + choice.index})
    async with asyncio.timeout(gw.config.engine_timeout_s):
        async for delta in gw.engine.generate(turn.plan.prompt_ids, params):
            choice.token_ids += delta.token_ids
            choice.logprobs += delta.logprobs
            choice.top_logprobs += delta.top_logprobs or []
            choice.text += delta.text
            if delta.version is not None and choice.version is None:
                choice.version = turn.version = delta.version
            if delta.finish_reason:
                choice.finish_reason = delta.finish_reason
            if on_delta is not None:
                on_delta()


def _reply(turn: Turn, choice: Choice) -> dict[str, Any]:
    if choice.forced_prefix:
        calls = parse_forced_call(choice.text)
        # Cut off by max_tokens, no call: report what the model saw and wrote.
        content = "" if calls else choice.forced_prefix + choice.text
    else:
        content, calls = parse_reply(choice.text, tools_enabled=_tools_enabled(turn))
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools_enabled(turn: Turn) -> bool:
    return bool(turn.tools) and turn.request.tool_choice != "none"


def _finish_reason(choice: Choice, message: dict[str, Any]) -> str:
    return "tool_calls" if message.get("tool_calls") else (choice.finish_reason or "stop")


async def _record(gw: Gateway, turn: Turn, replies: list[dict[str, Any]]) -> None:
    """Commit the session (if new) and one call per choice; return once durable."""
    plan = turn.plan
    prompt_delta = plan.prompt_ids[plan.prefix_len :]
    latency_ms = (time.perf_counter() - turn.started) * 1000
    calls: list[Call] = []
    for choice, reply in zip(turn.choices, replies, strict=True):
        state = history_hashes(turn.tools, [*turn.messages, canonical_message(reply)])[-1]
        calls.append(Call(
            id=f"{turn.completion_id}-{choice.index}", completion_id=turn.completion_id,
            choice_index=choice.index, session_id=turn.session_id, group_id=turn.group_id, seq=0,
            parent_id=plan.parent_id, link=plan.link, model=turn.request.model,
            policy_version=turn.version if choice.version is None else choice.version,
            finish_reason=_finish_reason(choice, reply), prefix_len=plan.prefix_len,
            prompt_tokens=len(plan.prompt_ids), completion_tokens=len(choice.token_ids),
            latency_ms=latency_ms, owner=turn.owner, state_hash=state,
            prompt_ids=encode_ids(prompt_delta), completion_ids=encode_ids(choice.token_ids),
            completion_logprobs=encode_floats(choice.logprobs), messages=turn.request.model_dump(
                exclude_none=True)["messages"], response_message=reply,
            request_params={k: v for k, v in turn.params.__dict__.items()},
        ))

    known = None if turn.new_session else await gw.session_info(turn.session_id)
    seq = (known or gw.new_session(turn.session_id, turn.owner, turn.group_id)).take_seq()
    rows = [{**call.model_dump(), "seq": seq} for call in calls]
    new_row = AgentSession(id=turn.session_id, group_id=turn.group_id, owner=turn.owner) if turn.new_session else None

    def write(db: Session) -> None:
        # Core statements, not ORM objects: this runs once per call in the single writer.
        if new_row is not None:
            queries.add_session_if_absent(db, session=new_row)
        else:
            db.execute(update(AgentSession).where(col(AgentSession.id) == turn.session_id)
                       .values(updated_at=utcnow()))
        db.execute(insert(Call), rows)

    await gw.writer.submit(write)
    if turn.new_session:
        gw.metrics.sessions.inc()
    gw.remember_calls(calls, [plan.prompt_ids + c.token_ids for c in turn.choices], len(turn.messages) + 1)
    if turn.parent is not None and plan.link in CHAINED_LINKS:
        turn.parent.has_child = True
    gw.metrics.tokens.labels("prompt").inc(len(plan.prompt_ids))
    gw.metrics.tokens.labels("completion").inc(sum(len(c.token_ids) for c in turn.choices))


def _logprobs(gw: Gateway, choice: Choice, start: int, end: int) -> dict[str, Any]:
    content = []
    for i in range(start, end):
        token = gw.renderer.token_text(choice.token_ids[i])
        tops = choice.top_logprobs[i] if i < len(choice.top_logprobs) else {}
        content.append({
            "token": token, "logprob": choice.logprobs[i], "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in tops.items()],
        })
    return {"content": content}


def _headers(turn: Turn) -> dict[str, str]:
    return {"X-Policy-Version": str(turn.version), "X-Session-Id": turn.session_id}


def _usage(turn: Turn) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in turn.choices)
    prompt = len(turn.plan.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _complete(gw: Gateway, turn: Turn) -> JSONResponse:
    await asyncio.gather(*(_generate(gw, turn, c) for c in turn.choices))
    replies = [_reply(turn, c) for c in turn.choices]
    await _record(gw, turn, replies)
    body = {
        "id": turn.completion_id, "object": "chat.completion", "created": int(time.time()),
        "model": turn.request.model,
        "choices": [
            {"index": c.index, "message": reply, "finish_reason": _finish_reason(c, reply),
             "logprobs": _logprobs(gw, c, 0, len(c.token_ids)) if turn.request.logprobs else None}
            for c, reply in zip(turn.choices, replies, strict=True)
        ],
        "usage": _usage(turn),
        "policy_version": turn.version,
        "session_id": turn.session_id,
    }
    return JSONResponse(body, headers=_headers(turn))


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class StreamRun:
    """The choices of a streamed request, generating concurrently and reporting through one queue."""

    def __init__(self, gw: Gateway, turn: Turn) -> None:
        self.events: asyncio.Queue[tuple[int, BaseException | None, bool]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._run(gw, turn, c)) for c in turn.choices]
        self.first: tuple[int, BaseException | None, bool] | None = None

    async def _run(self, gw: Gateway, turn: Turn, choice: Choice) -> None:
        try:
            await _generate(gw, turn, choice, lambda: self.events.put_nowait((choice.index, None, False)))
        except Exception as exc:
            self.events.put_nowait((choice.index, exc, True))
        else:
            self.events.put_nowait((choice.index, None, True))

    async def started(self) -> None:
        """Wait for the first token, so that an engine that is down still yields a proper status."""
        self.first = await self.events.get()
        if self.first[1] is not None:
            self.cancel()
            raise self.first[1]

    async def next(self) -> tuple[int, BaseException | None, bool]:
        if self.first is not None:
            event, self.first = self.first, None
            return event
        return await self.events.get()

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def _stream(gw: Gateway, turn: Turn, run: StreamRun) -> AsyncIterator[bytes]:
    created = int(time.time())
    tools_on = _tools_enabled(turn)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _sse({"id": turn.completion_id, "object": "chat.completion.chunk", "created": created,
                     "model": turn.request.model, "choices": choices, **extra})

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
                if turn.request.logprobs:
                    piece["logprobs"] = _logprobs(gw, c, sent_tokens[index], len(c.token_ids))
                    sent_tokens[index] = len(c.token_ids)
                c.emitted = len(visible)
                yield chunk([piece])
    finally:
        run.cancel()
    replies = [_reply(turn, c) for c in turn.choices]
    await _record(gw, turn, replies)
    for c, reply in zip(turn.choices, replies, strict=True):
        delta: dict[str, Any] = {}
        if reply.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(reply["tool_calls"])]
        elif len(reply.get("content") or "") > c.emitted:
            delta["content"] = reply["content"][c.emitted :]
        yield chunk([{"index": c.index, "delta": delta, "finish_reason": _finish_reason(c, reply)}],
                    policy_version=turn.version)
    if turn.request.stream_options and turn.request.stream_options.include_usage:
        yield chunk([], usage=_usage(turn))
    gw.metrics.latency.labels("true").observe(time.perf_counter() - turn.started)
    yield b"data: [DONE]\n\n"


@router.post("/v1/chat/completions")
@router.post("/s/{session}/v1/chat/completions")
@router.post("/s/{session}/g/{group}/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, caller: CallerDep) -> Any:
    gw: Gateway = request.app.state.gateway
    started = time.perf_counter()
    stream = "true" if body.stream else "false"
    try:
        turn = await _prepare(gw, request, body, caller.owner, caller.admin)
        if body.stream:
            run = StreamRun(gw, turn)
            await run.started()
            gw.metrics.requests.labels("200", stream).inc()
            return StreamingResponse(_stream(gw, turn, run), media_type="text/event-stream",
                                     headers=_headers(turn))
        response = await _complete(gw, turn)
    except TimeoutError as exc:
        gw.metrics.requests.labels("504", stream).inc()
        raise EngineError("The engine did not answer in time.", status=504, code="engine_timeout") from exc
    except (APIError, EngineError) as exc:
        gw.metrics.requests.labels(str(exc.status), stream).inc()
        raise
    gw.metrics.requests.labels("200", stream).inc()
    gw.metrics.latency.labels(stream).observe(time.perf_counter() - started)
    return response
