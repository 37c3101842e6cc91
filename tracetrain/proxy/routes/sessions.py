"""Reading back what was captured: sessions, their calls and rewards, trajectories, export."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from tracetrain.proxy.auth import AdminDep, CallerDep
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.gateway import Gateway
from tracetrain.store import queries
from tracetrain.store.export import iter_rows
from tracetrain.store.models import AgentSessionPublic, CallPublic, RewardPublic
from tracetrain.store.trajectory import session_trajectories

router = APIRouter()


async def _owned(gw: Gateway, session_id: str, caller: Any) -> None:
    info = await gw.session_info(session_id)
    if info is None:
        raise APIError(404, f"Session '{session_id}' does not exist.", code="session_not_found")
    if not caller.may_access(info.owner):
        raise APIError(403, f"Session '{session_id}' belongs to another API key.", code="session_forbidden")


@router.get("/v1/sessions")
async def list_sessions(request: Request, _: AdminDep, limit: int = Query(100, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=2**62)) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    rows = await gw.read(lambda db: queries.list_sessions(db, limit=limit, offset=offset))
    return {"object": "list", "data": [AgentSessionPublic.model_validate(r).model_dump(mode="json") for r in rows]}


@router.get("/v1/sessions/{session_id}")
async def get_session(request: Request, session_id: str, caller: CallerDep) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    await _owned(gw, session_id, caller)

    def read(db: Any) -> dict[str, Any]:
        session = queries.get_session(db, session_id=session_id)
        calls = queries.session_calls(db, session_id=session_id)
        rewards = queries.session_rewards(db, session_id=session_id)
        return {
            **AgentSessionPublic.model_validate(session).model_dump(mode="json"),
            "calls": [CallPublic.model_validate(c).model_dump(mode="json") for c in calls],
            "rewards": [RewardPublic.model_validate(r).model_dump(mode="json") for r in rewards],
            "reward_total": sum(r.value for r in rewards),
        }

    return await gw.read(read)  # type: ignore[no-any-return]


@router.get("/v1/sessions/{session_id}/trajectory")
async def get_trajectory(request: Request, session_id: str, caller: CallerDep) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    await _owned(gw, session_id, caller)

    def read(db: Any) -> dict[str, Any]:
        calls = queries.session_calls(db, session_id=session_id)
        rewards = queries.session_rewards(db, session_id=session_id)
        return {
            "session_id": session_id,
            "trajectories": session_trajectories(calls),
            "rewards": [RewardPublic.model_validate(r).model_dump(mode="json") for r in rewards],
        }

    return await gw.read(read)  # type: ignore[no-any-return]


@router.get("/v1/export")
async def export_jsonl(request: Request, _: AdminDep) -> StreamingResponse:
    gw: Gateway = request.app.state.gateway

    def lines() -> Iterator[bytes]:
        for row in iter_rows(gw.db):
            yield orjson.dumps(row) + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")
