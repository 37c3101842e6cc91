"""The serving core, the same for every API: bind → admit → chain → generate → record.

An API adapter (routes/chat.py, and the Responses, Messages and completions adapters to come) turns
its request into a `CallSpec`: canonical chat messages, tools, sampling parameters, a decoding
constraint, the session binding and what to keep of the original request. The core builds the
exact prompt ids (extending the session's token chain), lets the choices generate, parses each reply
into a canonical assistant message, and records the call. It knows no response format: adapters
shape what the client sees. The answer (a stream's last event) leaves only after the record is
committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tracetrain.engines.base import Affinity, EngineError, SamplingParams
from tracetrain.engines.publishing import line_version
from tracetrain.proxy.auth import Caller
from tracetrain.proxy.binding import Binding, header_value, prompt_group
from tracetrain.proxy.chain import ChainNode, PromptPlan, plan_prompt
from tracetrain.proxy.constraints import Constraint
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.gateway import Gateway
from tracetrain.proxy.redact import RequestRedaction, chat_states, extends_exactly, keep_call, redact_request
from tracetrain.proxy.render import (
    TOOL_CALL_OPEN,
    cut_call,
    history_hashes,
    parse_forced_call,
    parse_reply,
    partial_end,
)
from tracetrain.proxy.retries import Retried, find_retried
from tracetrain.proxy.session_directory import SessionState, forbidden_policy
from tracetrain.store import corrections, queries, retries
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.messages import shared_prefix
from tracetrain.store.models import CHAINED_LINKS, DEFAULT_POLICY, utcnow


@dataclass
class CallSpec:
    """One API request in the core's terms."""

    model: str
    messages: list[dict[str, Any]]
    """Canonical chat messages (render.canonical_message)."""
    tools: list[dict[str, Any]] | None
    tools_enabled: bool
    """False when the request forbids tool calls (`tool_choice: none`): replies are plain text."""
    params: SamplingParams
    constraint: Constraint | None
    n: int
    binding: Binding
    completion_id: str
    """The id the client sees (`chatcmpl-…`); calls are `<id>-<choice>`."""
    request_messages: list[dict[str, Any]]
    """The request's messages as the client sent them, stored with the call."""
    bypass_admission: bool = False
    record_params: dict[str, Any] = field(default_factory=dict)
    """API-specific settings kept with the call's sampling parameters (Responses: `store`)."""
    prompt_ids: list[int] | None = None
    """Text completions: the exact prompt ids (no chat template); the call extends the session's
    latest call when its whole chain is a prefix of them."""


@dataclass
class Choice:
    """One sampled choice as it accumulates."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    """Characters of visible text an adapter has streamed so far."""
    finish_reason: str | None = None
    version: int | None = None
    forced_prefix: str = ""
    """The tool-call opener put in the prompt for a forced call: the sampled text continues it."""
    route: dict[str, str] | None = None
    """The replica that served this choice and why (several engines behind the gateway)."""

    def visible_text(self, tools_enabled: bool) -> str:
        """Text safe to stream now: with tools on, hold back anything that may open a tool call, and the
        whitespace before it (a reply's content before its calls ends without it: render.parse_reply)."""
        if self.forced_prefix:
            return ""
        if not tools_enabled:
            return self.text
        start = self.text.find(TOOL_CALL_OPEN)
        if start >= 0:
            return self.text[:start].rstrip()
        opened = partial_end(self.text, TOOL_CALL_OPEN)
        return (self.text[:-opened] if opened else self.text).rstrip()


@dataclass
class Turn:
    """Everything about one request that generating and recording it needs."""

    spec: CallSpec
    session_id: str
    group_id: str
    new_session: bool
    policy: str
    """The named policy of its session (`call_policy`)."""
    owner: str | None
    plan: PromptPlan
    parent: ChainNode | None
    version: int
    started: float
    choices: list[Choice]
    pinned: int | None = None
    """The version to serve it with (canary promotion: the session's own); None: the engine's current."""
    redaction: RequestRedaction | None = None
    """What the request's messages hold (proxy/redact.py); None with `gateway.redaction: off`."""
    retried: Retried | None = None
    """The recorded request this one retries and replaces (proxy/retries.py)."""
    recorded: bool = False
    """Committed to the store: what a stream still sends after that needs no waiting."""

    def headers(self) -> dict[str, str]:
        """What every API's response carries: the policy version that answered and the session."""
        return {"X-Policy-Version": str(self.version), "X-Session-Id": header_value(self.session_id)}


async def model_policy(gw: Gateway, spec: CallSpec, caller: Caller) -> str | None:
    """The policy a call's `model` names (None: the served model's own name): 404 for a model that is neither
    served nor a policy, 403 `policy_forbidden` for one naming another policy than its key or path does."""
    named = await gw.policies.for_model(spec.model)
    if named is not None and caller.confined_elsewhere(named):
        raise APIError(403, f"This request is bound to policy '{caller.policy}' (by its API key or path); model "
                       f"'{spec.model}' names another policy.", code="policy_forbidden", param="model")
    return named


def call_policy(caller: Caller, named: str | None, session_id: str, stored: SessionState | None) -> str:
    """The named policy a call belongs to: its session's once the session exists (a session never changes
    policy: a model naming another is 403 `policy_forbidden`), else the one its key or path confines it to,
    else the one its `model` names (`named`), else the default."""
    if stored is not None:
        if named is not None and named != stored.policy:
            raise forbidden_policy(session_id, stored.policy, named)
        return stored.policy
    return caller.policy or named or DEFAULT_POLICY


async def prepare(gw: Gateway, spec: CallSpec, *, caller: Caller) -> Turn:
    """Bind the session (refusing another key's or another policy's) and its policy, admit it if new, and plan
    its exact prompt ids."""
    named = await model_policy(gw, spec, caller)
    session_id = spec.binding.session_id or spec.completion_id
    stored = await gw.sessions.owned(session_id, caller, must_exist=False) if spec.binding.session_id else None
    policy = call_policy(caller, named, session_id, stored)
    owner = caller.owner
    # The session's owner decides, as it decides training: an admin's call in it is still its users' data.
    redaction = redact_request(gw.redactors.of(stored.owner if stored else owner), spec.messages, spec.request_messages)
    hashed = redaction.messages if redaction else spec.messages
    group_id = spec.binding.group_id or (stored.group_id if stored else prompt_group(hashed))
    if stored is None:
        # Siblings are admitted together only in groups the agent named; a prompt-hash group can be
        # every session of an agent that asks the same thing.
        await gw.admission.admit(session_id, spec.binding.group_id, policy=policy, bypass=spec.bypass_admission)
    else:
        gw.admission.touch(session_id)
    if spec.prompt_ids is not None:
        parent = await gw.sessions.latest_node(session_id) if stored is not None else None
        plan = plan_tokens(spec.prompt_ids, parent)
    else:
        parent = None
        if stored is not None:
            parent = await gw.sessions.find_parent(session_id, history_hashes(spec.tools, hashed), spec.messages)
        exact = parent is None or extends_exactly(parent, spec.tools, spec.messages)
        plan = plan_prompt(gw.renderer, messages=spec.messages, tools=spec.tools, parent=parent if exact else None,
                           session_has_calls=stored is not None)
        if not exact and parent is not None:
            plan.parent_id, plan.link = parent.call_id, "redacted"
    if plan.parent_id is None and stored is not None:
        plan.parent_id = await gw.read(lambda db: queries.latest_call_id(db, session_id=session_id))
    retried = None
    if stored is not None and spec.prompt_ids is None:
        retried = await find_retried(gw, session_id=session_id, retry=spec.binding.retry, plan=plan,
                                     messages=redaction.sent if redaction else spec.request_messages)
    forced = spec.constraint.forced_prefix if spec.constraint else ""
    if forced:
        plan.prompt_ids = plan.prompt_ids + gw.renderer.encode(forced)
    pinned = gw.canaries.line(policy).version_for(new=stored is None, key=spec.binding.group_id or session_id,
                                                  pinned=stored.version if stored else None)
    return Turn(spec=spec, session_id=session_id, group_id=group_id, new_session=stored is None, policy=policy,
                owner=stored.owner if stored else owner, plan=plan, parent=parent,
                version=line_version(gw.engine, policy),
                started=time.perf_counter(), choices=[Choice(i, forced_prefix=forced) for i in range(spec.n)],
                pinned=pinned, redaction=redaction, retried=retried)


def plan_tokens(prompt_ids: list[int], latest: ChainNode | None) -> PromptPlan:
    """A token prompt extends the session's latest call when that call's whole chain is its prefix."""
    if latest is None:
        return PromptPlan(prompt_ids, 0, None, "start")
    n = len(latest.full_ids)
    if len(prompt_ids) >= n and prompt_ids[:n] == latest.full_ids:
        return PromptPlan(prompt_ids, n, latest.call_id, "branch" if latest.has_child else "extend")
    return PromptPlan(prompt_ids, 0, latest.call_id, "prefix_changed")


async def generate(gw: Gateway, turn: Turn, choice: Choice, on_delta: Callable[[], None] | None = None) -> None:
    """Sample one choice into `choice`, calling `on_delta` after each piece."""
    await gw.holds.wait()
    turn.version = line_version(gw.engine, turn.policy)
    params = turn.spec.params
    if turn.policy != DEFAULT_POLICY:  # its own line's adapter, or the base model before its first version
        params = replace(params, line=turn.policy)
    if params.seed is not None and choice.index:
        params = replace(params, seed=params.seed + choice.index)
    if turn.pinned is not None:
        params = replace(params, version=turn.pinned)
    affinity = Affinity(turn.session_id, turn.group_id)
    async with asyncio.timeout(gw.config.engine.timeout_s):
        async for delta in gw.engine.generate(turn.plan.prompt_ids, params, affinity):
            choice.token_ids += delta.token_ids
            choice.logprobs += delta.logprobs
            choice.top_logprobs += delta.top_logprobs or []
            choice.text += delta.text
            if delta.version is not None and choice.version is None:
                choice.version = turn.version = delta.version
            if delta.route is not None:
                choice.route = delta.route
            if delta.finish_reason:
                choice.finish_reason = delta.finish_reason
            if on_delta is not None:
                on_delta()


async def generate_all(gw: Gateway, turn: Turn) -> list[dict[str, Any]]:
    """Every choice to the end, then the canonical replies, recorded."""
    await asyncio.gather(*(generate(gw, turn, c) for c in turn.choices))
    replies = [reply_message(turn, c) for c in turn.choices]
    await record(gw, turn, replies)
    return replies


def reply_message(turn: Turn, choice: Choice) -> dict[str, Any]:
    """The finished choice as a canonical assistant message (content and/or tool calls). A tool call cut
    short by the token limit is still a call, with the arguments generated so far (render.parse_reply)."""
    cut = choice.finish_reason == "length"
    names = tuple(t.get("function", t).get("name", "") for t in turn.spec.tools or [])
    if choice.forced_prefix:
        content, calls = "", [parse_forced_call(choice.text, cut=cut, names=names)]
    else:
        content, calls = parse_reply(choice.text, tools_enabled=turn.spec.tools_enabled and bool(turn.spec.tools),
                                     cut=cut, names=names)
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    return message


def finish_reason(choice: Choice, message: dict[str, Any]) -> str:
    """OpenAI's finish reasons: `tool_calls` when the reply calls tools, `length` when a call was cut short,
    else the engine's."""
    calls = message.get("tool_calls") or []
    if any(cut_call(call) for call in calls):
        return "length"
    return "tool_calls" if calls else (choice.finish_reason or "stop")


def _inherited_messages(turn: Turn, sent: list[dict[str, Any]]) -> int:
    """Leading request messages (`sent`, as stored) the parent call already stores (see store/messages.py)."""
    parent = turn.parent
    if parent is None or parent.request_messages is None or parent.call_id != turn.plan.parent_id:
        return 0
    return shared_prefix(parent.request_messages, sent)


async def record(gw: Gateway, turn: Turn, replies: list[dict[str, Any]]) -> None:
    """Commit the session (if new) and one call per choice; return once durable."""
    plan, spec = turn.plan, turn.spec
    prompt_delta = plan.prompt_ids[plan.prefix_len :]
    latency_ms = (time.perf_counter() - turn.started) * 1000
    redacting, found = gw.redactors.of(turn.owner), turn.redaction
    sent = found.sent if found else spec.request_messages
    inherited = _inherited_messages(turn, sent)
    # What the store gets: placeholders and masked ids where redaction found something (proxy/redact.py).
    kept = keep_call(redacting, gw.renderer, found, prompt_delta=prompt_delta, replies=replies, inherited=inherited,
                     choices=[(c.text, c.token_ids) for c in turn.choices])
    real_states: list[str | None] = []
    # Plain rows, not `Call` objects: the ORM's per-instance bookkeeping showed in the gateway's profile,
    # and the rows go to a Core insert anyway. Keys are the `calls` columns.
    now = utcnow()
    rows: list[dict[str, Any]] = []
    for choice, reply in zip(turn.choices, replies, strict=True):
        i = choice.index
        if spec.prompt_ids is None:
            state, real = chat_states(redacting, found, spec.tools, spec.messages, reply)
        elif kept.redactions[i] is None:
            state, real = hashlib.sha256(encode_ids(plan.prompt_ids + choice.token_ids)).hexdigest(), None
        else:  # a hash of ids that spell a secret would keep it: hash what is stored
            stored_ids = encode_ids(kept.prompt_ids + kept.completions[i]) + (plan.parent_id or "").encode()
            state, real = hashlib.sha256(stored_ids).hexdigest(), None
        real_states.append(real)
        rows.append({
            "id": f"{spec.completion_id}-{choice.index}", "completion_id": spec.completion_id,
            "choice_index": choice.index, "session_id": turn.session_id, "group_id": turn.group_id, "seq": 0,
            "parent_id": plan.parent_id, "link": plan.link, "model": spec.model,
            "policy_version": turn.version if choice.version is None else choice.version,
            "finish_reason": finish_reason(choice, reply), "prefix_len": plan.prefix_len,
            "prompt_tokens": len(plan.prompt_ids), "completion_tokens": len(choice.token_ids),
            "latency_ms": latency_ms, "created_at": now, "owner": turn.owner, "state_hash": state,
            "prompt_ids": encode_ids(kept.prompt_ids), "completion_ids": encode_ids(kept.completions[i]),
            "completion_logprobs": encode_floats(choice.logprobs),
            "messages": sent[inherited:], "messages_inherited": inherited,
            "response_message": kept.replies[i], "redactions": kept.redactions[i],
            "request_params": {**spec.params.__dict__, **spec.record_params, **(choice.route or {})},
        })

    new_row = dict(id=turn.session_id, group_id=turn.group_id, owner=turn.owner,
                   policy_version=rows[0]["policy_version"], policy=turn.policy) if turn.new_session else None
    check_rollback = gw.config.promotion.mode == "canary"
    retried = turn.retried

    # Consent: the key's setting or the request's `X-Train: no` keeps the session out of training for good.
    no_train = ("no_train_key" if not gw.keys.trains(turn.owner)
                else "no_train_header" if not spec.binding.train else None)

    def write(db: Any) -> int:
        if retried is not None:
            retries.drop_retried(db, session_id=turn.session_id, completion_id=retried.completion_id,
                                 new_completion_id=spec.completion_id)
        seq = queries.record_calls(db, session_id=turn.session_id, new_session=new_row, rows=rows,
                                   check_rollback=check_rollback, redactions=kept.counts)
        if new_row is not None:
            # Two first calls of one session may race (in two gateway processes, say): the second's insert does
            # nothing, and its calls must not land in a session of another policy. Raising rolls them back.
            stored = queries.session_owner_group(db.connection(), session_id=turn.session_id)
            if stored is not None and stored[3] != turn.policy:
                raise forbidden_policy(turn.session_id, stored[3], turn.policy)
        if no_train is not None:
            corrections.mark_no_train(db, session_id=turn.session_id, reason=no_train, actor=turn.owner)
        return seq

    await gw.writer.submit(write)
    if retried is not None:
        gw.sessions.forget_calls(turn.session_id, retried.state_hashes)
    gw.sessions.delivered(turn.session_id, spec.completion_id)
    gw.publishing.note_served(max(row["policy_version"] for row in rows), turn.policy)
    if turn.new_session:
        gw.sessions.new(turn.session_id, turn.owner, turn.group_id, rows[0]["policy_version"], turn.policy)
        gw.metrics.sessions.inc()
    chains = [plan.prompt_ids + c.token_ids for c in turn.choices]
    gw.sessions.remember_calls(turn.session_id, [(row["id"], row["state_hash"]) for row in rows], chains,
                               len(spec.messages) + 1, sent, real_states=real_states)
    # Every call, whatever its API: a text completion in the same session extends the latest one.
    gw.sessions.remember_latest(turn.session_id, ChainNode(rows[0]["id"], chains[0], 0))
    if turn.parent is not None and plan.link in CHAINED_LINKS:
        turn.parent.has_child = True
    turn.recorded = True
    gw.metrics.tokens.labels("prompt").inc(len(plan.prompt_ids))
    gw.metrics.tokens.labels("completion").inc(sum(len(c.token_ids) for c in turn.choices))


@contextlib.asynccontextmanager
async def counted(gw: Gateway, stream: bool) -> AsyncIterator[None]:
    """Count a request's outcome in the gateway's metrics (a non-streamed one's latency too; a stream's
    is observed when it ends); an engine timeout becomes a 504 in the API's error shape."""
    label = "true" if stream else "false"
    started = time.perf_counter()
    try:
        yield
    except TimeoutError as exc:
        gw.metrics.requests.labels("504", label).inc()
        raise EngineError("The engine did not answer in time.", status=504, code="engine_timeout") from exc
    except (APIError, EngineError) as exc:
        gw.metrics.requests.labels(str(exc.status), label).inc()
        raise
    gw.metrics.requests.labels("200", label).inc()
    if not stream:
        gw.metrics.latency.labels(label).observe(time.perf_counter() - started)


async def text_pieces(turn: Turn, run: StreamRun) -> AsyncIterator[str]:
    """The visible text of a one-choice stream as it grows, piece by piece (an engine error is raised)."""
    choice = turn.choices[0]
    tools_on = turn.spec.tools_enabled and bool(turn.spec.tools)
    try:
        finished = False
        while not finished:
            _, error, finished = await run.next()
            if error is not None:
                raise error
            visible = choice.visible_text(tools_on)
            if len(visible) > choice.emitted:
                piece, choice.emitted = visible[choice.emitted :], len(visible)
                yield piece
    finally:
        run.cancel()


async def finish_stream(gw: Gateway, turn: Turn) -> tuple[dict[str, Any], str]:
    """Record a finished one-choice stream: its reply, and the reply text not streamed yet (text held
    back as a possible tool call that turned out to be text)."""
    choice = turn.choices[0]
    reply = reply_message(turn, choice)
    await record(gw, turn, [reply])
    return reply, (reply.get("content") or "")[choice.emitted :]


class StreamRun:
    """The choices of a streamed request, generating concurrently and reporting through one queue."""

    def __init__(self, gw: Gateway, turn: Turn) -> None:
        self.gw = gw
        self.turn = turn
        self.events: asyncio.Queue[tuple[int, BaseException | None, bool]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._run(gw, turn, c)) for c in turn.choices]
        self.first: tuple[int, BaseException | None, bool] | None = None

    async def _run(self, gw: Gateway, turn: Turn, choice: Choice) -> None:
        try:
            await generate(gw, turn, choice, lambda: self.events.put_nowait((choice.index, None, False)))
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

    def ready(self) -> bool:
        """Whether `next` answers without waiting, or the call is recorded and the rest of the stream needs
        no waiting either (see proxy/event_stream.py; a stream yields `FLUSH` before it waits otherwise)."""
        return self.first is not None or not self.events.empty() or self.turn.recorded

    async def next(self) -> tuple[int, BaseException | None, bool]:
        """(choice index, error or None, whether that choice finished)."""
        if self.first is not None:
            event, self.first = self.first, None
            return event
        return await self.events.get()

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    def dropped(self) -> None:
        """The client left before the stream ended: its call, if recorded (or being recorded: the write goes
        on without the request), may be asked again (proxy/retries.py)."""
        self.gw.sessions.mark_undelivered(self.turn.session_id, self.turn.spec.completion_id)
