"""Holding new generations (admin only): what a `sync`-mode trainer in another process uses.

A hold is stored, so every gateway process on the store obeys it (each mirrors the store's holds
every 0.25 s). While a holder holds generation, chat requests wait before they reach the engine (requests already
generating finish), so the samples of the next step all come from the new policy. A hold expires
after `ttl_s`, so a trainer that dies mid-step cannot stall the agents for longer than that.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field

from tracetrain.proxy.auth import AdminDep
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.holds import REMOTE
from tracetrain.proxy.openapi import error_responses
from tracetrain.proxy.protocol import RequestModel
from tracetrain.store import holds as store_holds

router = APIRouter(responses=error_responses(401, 403))


class HoldRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    holder: str = Field(default="trainer", min_length=1, max_length=128)
    ttl_s: float = Field(default=600.0, gt=0, le=86_400)
    """Seconds after which the hold lapses by itself."""


class ReleaseRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    holder: str = Field(default="trainer", min_length=1, max_length=128)


def _state(gw: Gateway) -> dict[str, Any]:
    return {"open": gw.holds.is_free(), "holders": gw.holds.holders}


@router.get("/v1/generation")
async def generation_state(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    return _state(gw)


@router.post("/v1/generation/hold")
async def hold_generation(gw: GatewayDep, body: HoldRequest, _: AdminDep) -> dict[str, Any]:
    await gw.writer.submit(lambda db: store_holds.hold(db, holder=body.holder, ttl_s=body.ttl_s))
    gw.holds.hold(REMOTE + body.holder, body.ttl_s)  # here at once; other processes within a poll
    return _state(gw)


@router.post("/v1/generation/release")
async def release_generation(gw: GatewayDep, body: ReleaseRequest, _: AdminDep) -> dict[str, Any]:
    await gw.writer.submit(lambda db: store_holds.release(db, holder=body.holder))
    gw.holds.release(REMOTE + body.holder)
    return _state(gw)
