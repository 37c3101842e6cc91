"""Health, Prometheus metrics and the model list."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tracetrain.proxy.auth import CallerDep, get_admin, get_caller
from tracetrain.proxy.gateway import GatewayDep
from tracetrain.proxy.openapi import error_responses

router = APIRouter()


@router.get("/health")
async def health(gw: GatewayDep) -> dict[str, Any]:
    return {"status": "ok", "policy_version": gw.engine.version, "store_queue_depth": gw.writer.queue_depth}


async def metrics_access(request: Request, gw: GatewayDep) -> None:
    """`/metrics` as open as `gateway.metrics_key` allows: counters reveal traffic, so a gateway on a shared
    network may want them behind a key."""
    if gw.config.gateway.metrics_key == "none":
        return
    caller = await get_caller(request)
    if gw.config.gateway.metrics_key == "admin":
        await get_admin(caller)


class PrometheusText(Response):
    """Declares its media type on the class, so that the OpenAPI document states it (not JSON)."""

    media_type = "text/plain"


@router.get("/metrics", dependencies=[Depends(metrics_access)], response_class=PrometheusText,
            responses=error_responses(401, 403))
async def metrics(gw: GatewayDep) -> Response:
    """Prometheus' text exposition format."""
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", responses=error_responses(401))
@router.get("/s/{session}/v1/models", responses=error_responses(401))
@router.get("/s/{session}/g/{group}/v1/models", responses=error_responses(401))
async def models(gw: GatewayDep, _: CallerDep) -> dict[str, Any]:
    name = gw.config.engine.served_model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                        "owned_by": "tracetrain", "policy_version": gw.engine.version}]}
