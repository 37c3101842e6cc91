"""Reading back what was captured: sessions, their calls and rewards, trajectories, export."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from sqlmodel import Session

from tracetrain.proxy.auth import AdminDep, CallerDep
from tracetrain.proxy.console_protocol import SessionList, SessionSummary, conversation_items
from tracetrain.proxy.gateway import GatewayDep
from tracetrain.proxy.openapi import error_responses
from tracetrain.proxy.policy_lines import PolicyQuery, scoped_policy
from tracetrain.store import console, queries
from tracetrain.store.console import SessionFilter
from tracetrain.store.export import iter_rows, record_export
from tracetrain.store.models import AgentSessionPublic, CallPublic, RewardPublic
from tracetrain.store.trajectory import session_trajectories

router = APIRouter()


@router.get("/v1/sessions", response_model=SessionList, responses=error_responses(
    401, 403, 404, described={403: "A policy the API key is not bound to", 404: "No such policy"}))
async def list_sessions(
    gw: GatewayDep, caller: CallerDep,
    limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=2**62),
    status: Literal["open", "final"] | None = Query(None, description="`final` once a final reward arrived."),
    reward_min: float | None = Query(None, allow_inf_nan=False), reward_max: float | None = Query(
        None, allow_inf_nan=False, description="Bounds on the reward the trainer uses (sessions without one "
        "match no bound)."),
    group: str | None = Query(None, max_length=256), model: str | None = Query(None, max_length=256),
    q: str | None = Query(None, min_length=1, max_length=256, pattern="^[^\\x00]+$",
                          description="Case-insensitive text in any stored message or reply of the session (no NUL "
                          "character: SQLite's text search cannot take one)."),
    excluded: bool | None = None, trained: bool | None = Query(None, description="Whether a trainer learned from it."),
    sort: Literal["created", "updated", "reward", "calls", "tokens"] = "created",
    order: Literal["asc", "desc"] = "desc",
    policy: PolicyQuery = None,
) -> SessionList:
    """Sessions, newest first by default; an agent key sees only its own, the admin key every session; a key
    bound to a policy only that policy's."""
    where = SessionFilter(owner=caller.owner, only_owner=not caller.admin, status=status, reward_min=reward_min,
                          reward_max=reward_max, group_id=group, model=model, text=q, excluded=excluded,
                          trained=trained, policy=await scoped_policy(gw.policies, caller, policy))

    def read(db: Session) -> SessionList:
        rows, total = console.search_sessions(db, where=where, sort=sort, descending=order == "desc", limit=limit,
                                              offset=offset)
        spans = console.version_spans(db, session_ids=[r.id for r in rows])
        data = [SessionSummary.model_validate(r, update=dict(zip(("policy_version_min", "policy_version_max"),
                                                                 spans.get(r.id, (None, None)), strict=True)))
                for r in rows]
        return SessionList(data=data, total=total, has_more=offset + len(rows) < total, limit=limit, offset=offset)

    return await gw.read(read)  # type: ignore[no-any-return]


@router.get("/v1/sessions/{session_id}", responses=error_responses(401, 403, 404))
async def get_session(gw: GatewayDep, session_id: str, caller: CallerDep) -> dict[str, Any]:
    """The session, its calls and its reward events. Each call carries `added_items` (what its request added
    after its parent's reply: tool results, user turns) and `reply_items` (its reply's text and tool calls),
    whatever API it came through (see `ConversationItem`)."""
    await gw.sessions.owned(session_id, caller)

    def read(db: Any) -> dict[str, Any]:
        session = queries.get_session(db, session_id=session_id)
        calls = queries.session_calls(db, session_id=session_id)
        rewards = queries.session_rewards(db, session_id=session_id)
        items = conversation_items(calls)  # for the console's call tree: tool calls and results as items
        return {
            **AgentSessionPublic.model_validate(session).model_dump(mode="json"),
            "calls": [{**CallPublic.model_validate(c).model_dump(mode="json"), **items[c.id]} for c in calls],
            "rewards": [RewardPublic.model_validate(r).model_dump(mode="json") for r in rewards],
            "reward_total": sum(r.value for r in rewards),
        }

    return await gw.read(read)  # type: ignore[no-any-return]


@router.get("/v1/sessions/{session_id}/trajectory", responses=error_responses(401, 403, 404))
async def get_trajectory(
    gw: GatewayDep, session_id: str, caller: CallerDep,
    text: bool = Query(False, description="Add `token_texts` to each segment: every token's own text, "
                       "decoded by the gateway's tokenizer."),
) -> dict[str, Any]:
    await gw.sessions.owned(session_id, caller)

    def read(db: Any) -> dict[str, Any]:
        session = queries.get_session(db, session_id=session_id)
        # A purged session's calls have no token ids left: no trajectory to rebuild.
        calls = queries.session_calls(db, session_id=session_id) if session and session.purged is None else []
        rewards = queries.session_rewards(db, session_id=session_id)
        return {
            "session_id": session_id,
            "purged": session.purged if session else None,
            "trajectories": session_trajectories(calls),
            "rewards": [RewardPublic.model_validate(r).model_dump(mode="json") for r in rewards],
        }

    found: dict[str, Any] = await gw.read(read)
    if text:
        segments = [seg for trajectory in found["trajectories"] for seg in trajectory["segments"]]
        texts = await asyncio.to_thread(lambda: [gw.renderer.token_texts(seg["token_ids"]) for seg in segments])
        for seg, seg_texts in zip(segments, texts, strict=True):
            seg["token_texts"] = seg_texts
    return found


class NDJSONStream(StreamingResponse):
    """Declares its media type on the class, so that the OpenAPI document states it (not JSON)."""

    media_type = "application/x-ndjson"


@router.get("/v1/export", response_class=NDJSONStream, responses=error_responses(
    401, 403, 404, described={404: "No such policy"}))
async def export_jsonl(gw: GatewayDep, caller: AdminDep, policy: PolicyQuery = None) -> NDJSONStream:
    """Every trajectory segment, one JSON object per line (only one named policy's with `policy`); sessions not
    for training or purged are left out. Recorded in the audit log (`GET /v1/audit`) before the first line."""
    only = await scoped_policy(gw.policies, caller, policy)
    await gw.writer.submit(lambda db: record_export(db, actor=caller.owner, fmt="jsonl", policy=only))

    def lines() -> Iterator[bytes]:
        for row in iter_rows(gw.db, policy=only):
            yield orjson.dumps(row) + b"\n"

    return NDJSONStream(lines())
