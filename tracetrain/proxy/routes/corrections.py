"""An admin's corrections to a session, which the trainer honours: exclude it from training, include it
again, mark it never to be trained on (consent withdrawn), override its reward with a note, clear the
override; the audit trail of them (who, by key fingerprint, and when); and deleting a session's content
for an erasure request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Body
from sqlmodel import Session

from tracetrain.proxy.auth import ADMIN, AdminDep, Caller
from tracetrain.proxy.console_protocol import (
    ActionList,
    CorrectionResponse,
    EraseRequest,
    ErasureResponse,
    NoteRequest,
    RewardOverrideRequest,
)
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.openapi import error_responses
from tracetrain.store import corrections, retention
from tracetrain.store.models import AgentSession, SessionAction, SessionActionPublic

router = APIRouter(responses=error_responses(401, 403, 404))

Change = Callable[[Session], tuple[AgentSession, SessionAction | None] | None]
"""A correction in the writer's transaction: (the session after it, the action recorded), or None when the
session does not exist; no action when there was nothing to change."""


def _missing(session_id: str) -> APIError:
    return APIError(404, f"Session '{session_id}' does not exist.", code="session_not_found")


async def _apply(gw: Gateway, session_id: str, change: Change, unchanged: APIError | None = None,
                 ) -> CorrectionResponse:
    """Run `change` through the store writer; `unchanged` is the error to answer when it recorded nothing."""
    await gw.sessions.owned(session_id, ADMIN)

    def write(db: Session) -> CorrectionResponse | bool:
        done = change(db)
        if done is None:
            return False
        session, action = done
        if action is None:
            return True
        return CorrectionResponse(session_id=session.id, excluded=session.excluded, reward=session.reward,
                                  reward_override=session.reward_override, trained_version=session.trained_version,
                                  action=SessionActionPublic.model_validate(action))

    result: CorrectionResponse | bool = await gw.writer.submit(write)
    if result is False:
        raise _missing(session_id)
    if result is True:
        raise unchanged or APIError(409, "Nothing to change.", code="unchanged")
    return result


async def _exclusion(gw: Gateway, session_id: str, caller: Caller, body: NoteRequest | None,
                     excluded: bool) -> CorrectionResponse:
    note = body.note if body is not None else ""
    unchanged = APIError(409, f"Session '{session_id}' is not for training (its key, its request or an admin "
                         "said so): it cannot be included.", code="not_for_training")
    return await _apply(gw, session_id, lambda db: corrections.set_excluded(
        db, session_id=session_id, excluded=excluded, actor=caller.owner, note=note), unchanged)


@router.post("/v1/sessions/{session_id}/exclude", response_model=CorrectionResponse)
async def exclude(gw: GatewayDep, session_id: str, caller: AdminDep,
                  body: Annotated[NoteRequest | None, Body()] = None) -> CorrectionResponse:
    """Keep the session out of training (online and offline) until it is included again."""
    return await _exclusion(gw, session_id, caller, body, True)


@router.post("/v1/sessions/{session_id}/include", response_model=CorrectionResponse,
             responses=error_responses(409))
async def include(gw: GatewayDep, session_id: str, caller: AdminDep,
                  body: Annotated[NoteRequest | None, Body()] = None) -> CorrectionResponse:
    """Let an excluded session be trained on again. 409 `not_for_training` for a session not for training."""
    return await _exclusion(gw, session_id, caller, body, False)


@router.post("/v1/sessions/{session_id}/no_train", response_model=CorrectionResponse,
             responses=error_responses(409))
async def no_train(gw: GatewayDep, session_id: str, caller: AdminDep,
                   body: Annotated[NoteRequest | None, Body()] = None) -> CorrectionResponse:
    """Never train on the session or export it for training (a user withdrew consent); it stays served and
    kept for audit, and no one can include it again. 409 `not_for_training` when it already is."""
    note = body.note if body is not None else ""
    unchanged = APIError(409, f"Session '{session_id}' is already not for training.", code="not_for_training")
    return await _apply(gw, session_id, lambda db: corrections.mark_no_train(
        db, session_id=session_id, reason="no_train_admin", actor=caller.owner, note=note), unchanged)


@router.post("/v1/sessions/{session_id}/reward_override", response_model=CorrectionResponse)
async def reward_override(gw: GatewayDep, session_id: str, body: RewardOverrideRequest,
                          caller: AdminDep) -> CorrectionResponse:
    """Make `reward` the session's reward for training, in place of every posted reward."""
    return await _apply(gw, session_id, lambda db: corrections.override_reward(
        db, session_id=session_id, reward=body.reward, actor=caller.owner, note=body.note))


@router.delete("/v1/sessions/{session_id}/reward_override", response_model=CorrectionResponse,
               responses=error_responses(409))
async def clear_reward_override(gw: GatewayDep, session_id: str, caller: AdminDep,
                                body: Annotated[NoteRequest | None, Body()] = None) -> CorrectionResponse:
    """Remove the session's reward override: its reward for training is the sum of its posted rewards
    again (per-call ones included; none posted: no reward). 409 `no_reward_override` when it has none."""
    note = body.note if body is not None else ""
    unchanged = APIError(409, f"Session '{session_id}' has no reward override to clear.", code="no_reward_override")
    return await _apply(gw, session_id, lambda db: corrections.clear_reward_override(
        db, session_id=session_id, actor=caller.owner, note=note), unchanged)


@router.get("/v1/sessions/{session_id}/actions", response_model=ActionList)
async def actions(gw: GatewayDep, session_id: str, _: AdminDep) -> ActionList:
    """Every correction made to the session, oldest first."""
    await gw.sessions.owned(session_id, ADMIN)
    rows = await gw.read(lambda db: corrections.session_actions(db, session_id=session_id))
    return ActionList(data=[SessionActionPublic.model_validate(r) for r in rows])


@router.delete("/v1/sessions/{session_id}", response_model=ErasureResponse)
async def delete_session(gw: GatewayDep, session_id: str, caller: AdminDep,
                         body: Annotated[EraseRequest | None, Body()] = None) -> ErasureResponse:
    """Delete the session's content now, for a user's erasure request: its calls' messages, replies, token
    ids and logprobs are cleared (as a retention purge clears them), whatever its age, and it is marked
    `deleted`, never trained on or exported. Its row, counts and rewards stay for the figures; the audit log
    records who asked and `reason`. Repeating the request answers the same (`already_deleted`), clears any
    call recorded since, and adds no audit entry."""
    await gw.sessions.owned(session_id, ADMIN)
    reason = body.reason if body is not None else ""
    erased = await gw.writer.submit(lambda db: retention.erase_session(
        db, session_id=session_id, actor=caller.owner, reason=reason))
    if erased is None:
        raise _missing(session_id)
    gw.sessions.forget_session(session_id)
    await retention.scrub(gw.writer.submit, gw.db)
    session = erased.session
    assert session.purged is not None and session.purged_at is not None
    return ErasureResponse(session_id=session.id, purged=session.purged, purged_at=session.purged_at,
                           calls_cleared=erased.calls, already_deleted=erased.already)
