"""The engines behind the gateway: which replicas serve, at which version, and what happened to them."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from tracetrain.proxy.auth import AdminDep
from tracetrain.proxy.gateway import GatewayDep
from tracetrain.proxy.openapi import error_responses

router = APIRouter(responses=error_responses(401, 403))


class ReplicaState(BaseModel):
    replica: str
    """The replica's base URL."""
    up: bool
    """Whether it takes calls now."""
    version: int
    """The policy version it serves."""
    outstanding: int
    """Requests sent to it and not finished."""
    reason: str | None
    """Why it is out of service, while it is."""
    self_started: bool
    """Whether the gateway started it (and restarts it when it exits)."""
    canary: bool = False
    """Whether it holds a full-weight canary (canary promotion): only that version's sessions go there."""


class ReplicaEventPublic(BaseModel):
    at: float
    """Unix time."""
    replica: str
    event: str
    """`down`, `up`, `restarting` or `publish_failed`."""
    detail: str


class ReplicaList(BaseModel):
    object: str = "list"
    served_version: int
    data: list[ReplicaState]
    events: list[ReplicaEventPublic]
    """The latest events, newest last (at most 100)."""


@router.get("/v1/replicas", response_model=ReplicaList)
async def list_replicas(gw: GatewayDep, _: AdminDep) -> ReplicaList:
    engine = gw.engine
    state = engine.state() if hasattr(engine, "state") else [  # one engine, no replica set
        {"replica": engine.model_name, "up": True, "version": engine.version, "outstanding": 0, "reason": None,
         "self_started": False}]
    events = list(getattr(engine, "events", []))[-100:]
    return ReplicaList(served_version=engine.version, data=[ReplicaState(**s) for s in state],
                       events=[ReplicaEventPublic(**e.__dict__) for e in events])
