"""POST /v1/rewards: rewards are events that may arrive any time after the calls they judge."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from tracetrain.proxy.auth import CallerDep
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.openapi import error_responses
from tracetrain.proxy.protocol import RewardRequest, RewardResponse, SessionRewardRequest
from tracetrain.store import queries
from tracetrain.store.models import Reward

router = APIRouter(responses=error_responses(
    401, 403, 404, 409, described={403: "The session belongs to another API key", 404: "No such session or call",
                                   409: "The idempotency key was used with a different reward"}))


def combine(reward: float | dict[str, float], weights: dict[str, float]) -> float:
    if isinstance(reward, dict):
        return float(sum(weights.get(name, 1.0) * value for name, value in reward.items()))
    return float(reward)


async def _target(gw: Gateway, body: SessionRewardRequest, path_session: str | None) -> tuple[str, str | None]:
    """(session id, call id) the reward is for."""
    session_id = body.session_id or path_session  # an empty session_id names none, as in a binding
    if body.completion_id is None:
        if session_id is None:
            raise APIError(400, "Give a session_id or a completion_id.", code="missing_target")
        return session_id, None
    calls = await gw.read(lambda db: queries.calls_by_completion(db, completion_id=body.completion_id))
    call = next((c for c in calls if c.choice_index == body.choice_index), None)
    if call is None:
        raise APIError(404, f"No call with completion id '{body.completion_id}' and choice "
                       f"{body.choice_index}.", code="completion_not_found", param="completion_id")
    if session_id is not None and session_id != call.session_id:
        raise APIError(400, f"Completion '{body.completion_id}' belongs to session '{call.session_id}', "
                       f"not '{session_id}'.", code="session_mismatch")
    return call.session_id, call.id


async def post_reward(gw: Gateway, body: SessionRewardRequest, caller: CallerDep,
                      path_session: str | None = None) -> RewardResponse:
    session_id, call_id = await _target(gw, body, path_session)
    await gw.sessions.owned(session_id, caller)
    value = combine(body.reward, gw.config.gateway.reward_weights)
    components = body.reward if isinstance(body.reward, dict) else None

    def write(db: Session) -> RewardResponse:
        if body.idempotency_key is not None:
            seen = queries.reward_by_key(db, session_id=session_id, idempotency_key=body.idempotency_key)
            if seen is not None:
                if (seen.value, seen.call_id, seen.final, seen.components) != (value, call_id, body.final,
                                                                                components):
                    raise APIError(409, f"Idempotency key '{body.idempotency_key}' was used with a different "
                                   "reward.", code="idempotency_conflict", param="idempotency_key")
                return RewardResponse(id=seen.id or 0, session_id=session_id, call_id=call_id, value=value,
                                      final=seen.final, duplicate=True)
        reward = Reward(session_id=session_id, call_id=call_id, value=value, components=components,
                        final=body.final, idempotency_key=body.idempotency_key)
        queries.add_reward(db, reward=reward)
        db.flush()
        return RewardResponse(id=reward.id or 0, session_id=session_id, call_id=call_id, value=value,
                              final=body.final)

    try:
        result: RewardResponse = await gw.writer.submit(write)
    except IntegrityError:
        if body.idempotency_key is None:
            raise
        # Another gateway process stored the same key between this one's check and insert (PostgreSQL
        # checks the unique key at insert): the second try finds it and answers as a duplicate.
        result = await gw.writer.submit(write)
    if not result.duplicate:
        gw.metrics.rewards.inc()
        if result.final:
            gw.admission.finished(session_id)
    return result


@router.post("/v1/rewards", response_model=RewardResponse)
async def rewards(gw: GatewayDep, body: Annotated[RewardRequest, Body()], caller: CallerDep) -> RewardResponse:
    return await post_reward(gw, body, caller)


@router.post("/s/{session}/v1/rewards", response_model=RewardResponse)
@router.post("/s/{session}/g/{group}/v1/rewards", response_model=RewardResponse)
async def session_rewards(gw: GatewayDep, body: SessionRewardRequest, caller: CallerDep,
                          session: Annotated[str, Path()]) -> RewardResponse:
    return await post_reward(gw, body, caller, path_session=session)
