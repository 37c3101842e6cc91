"""Policy versions: list them with their training figures, and publish a new one (admin only).

A trainer running as its own process (`tracetrain train`) hands each checkpoint to the gateway
here; the gateway owns the engine, so it loads the weights and switches versions atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from sqlmodel import Session

from tracetrain.engines.base import EngineError
from tracetrain.engines.publishing import Checkpoint, PublishError
from tracetrain.proxy.auth import AdminDep
from tracetrain.proxy.errors import APIError
from tracetrain.proxy.gateway import Gateway
from tracetrain.store import leases, queries
from tracetrain.store.models import Policy

router = APIRouter()


class PublishRequest(BaseModel):
    version: int = Field(ge=1)
    checkpoint: str
    """Directory of the checkpoint, as the gateway's machine sees it."""
    kind: Literal["full", "lora"]


@router.get("/v1/policies")
async def list_policies(request: Request, _: AdminDep) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway

    def read(db: Session) -> tuple[Sequence[Policy], int, int, dict[str, int]]:
        return (queries.list_policies(db), leases.ready_count(db), leases.leased_count(db),
                leases.set_aside_counts(db))

    rows, ready, leased, set_aside = await gw.read(read)
    return {"object": "list", "served_version": gw.engine.version,
            # Sessions waiting for the trainer, claimed for a step in progress, and those it left in the
            # store unconsumed, by reason.
            "sessions": {"ready": ready, "leased": leased, "set_aside": set_aside},
            "data": [row.model_dump(mode="json") for row in rows]}


@router.post("/v1/policies")
async def publish_policy(request: Request, body: PublishRequest, _: AdminDep) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    path = Path(body.checkpoint)
    if not path.is_dir():
        raise APIError(400, f"Checkpoint directory '{path}' does not exist on the gateway's machine.",
                       code="checkpoint_not_found", param="checkpoint")
    try:
        await gw.publish(Checkpoint(body.version, path, body.kind))
    except (PublishError, EngineError) as exc:
        raise APIError(502, f"Publishing version {body.version} failed; still serving version "
                       f"{gw.engine.version}: {exc}", code="publish_failed") from exc
    gw.metrics.policy_version.set(gw.engine.version)
    return {"version": gw.engine.version, "published": True}
