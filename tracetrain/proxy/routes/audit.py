"""The audit log: who exported, corrected, marked not for training, purged or deleted what, and when
(store/audit.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from fastapi import APIRouter, Query
from sqlmodel import Session

from tracetrain.proxy.auth import AdminDep
from tracetrain.proxy.console_protocol import AuditEntryPublic, AuditList
from tracetrain.proxy.gateway import GatewayDep
from tracetrain.proxy.openapi import error_responses
from tracetrain.store import audit

router = APIRouter()


@router.get("/v1/audit", response_model=AuditList, responses=error_responses(401, 403))
async def audit_log(
    gw: GatewayDep, _: AdminDep,
    limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=2**62),
    action: Literal["export", "correction", "no_train", "purge", "delete"] | None = Query(
        None, description="Only entries of this action."),
    session_id: str | None = Query(None, min_length=1, max_length=256,
                                   description="Only entries about this one session."),
) -> AuditList:
    """Entries newest first (admin only)."""

    def read(db: Session) -> AuditList:
        rows, total = audit.entries(db, action=action, session_id=session_id, limit=limit, offset=offset)
        return AuditList(data=[AuditEntryPublic.model_validate(asdict(r)) for r in rows], total=total,
                         has_more=offset + len(rows) < total, limit=limit, offset=offset)

    return await gw.read(read)  # type: ignore[no-any-return]
