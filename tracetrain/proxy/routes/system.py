"""Health, Prometheus metrics and the model list."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tracetrain.proxy.auth import CallerDep
from tracetrain.proxy.gateway import Gateway

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    return {"status": "ok", "policy_version": gw.engine.version, "store_queue_depth": gw.writer.queue_depth}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
@router.get("/s/{session}/v1/models")
@router.get("/s/{session}/g/{group}/v1/models")
async def models(request: Request, _: CallerDep) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    name = gw.config.served_model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                        "owned_by": "tracetrain", "policy_version": gw.engine.version}]}
