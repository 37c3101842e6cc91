"""The FastAPI application: routers, error shape, body-size limit, requests in flight, and the writer's
lifetime."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracetrain.proxy.binding import check_path_ids
from tracetrain.proxy.console_ui import mount_console
from tracetrain.proxy.errors import BodyTooLarge, error_for_path, install_error_handlers
from tracetrain.proxy.gateway import Gateway
from tracetrain.proxy.openapi import install_openapi
from tracetrain.proxy.routes import (
    audit,
    chat,
    completions,
    console,
    corrections,
    generation,
    messages,
    policies,
    replicas,
    responses,
    rewards,
    sessions,
    stats,
    system,
)


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413, by Content-Length or while streaming in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit)  # answered with 413 by the app's exception handler
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        too_large = BodyTooLarge(self.limit)
        await error_for_path(scope["path"], 413, too_large.detail, too_large.code)(scope, receive, send)


class InFlight:
    """Keep `gateway.load.requests`: the store's writer commits on the event loop only while one
    request is in progress (store/writer.py)."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.gateway.load.requests += 1
        try:
            await self.app(scope, receive, send)  # returns once the response is sent, a stream's too
        finally:
            self.gateway.load.requests -= 1


SESSION_PREFIXES = ("/s/{session}/g/{group}", "/s/{session}")
POLICY_PREFIX = "/p/{policy}"


def policy_paths(routers: list[APIRouter]) -> APIRouter:
    """Every route that binds a session by its path (`/s/{session}/…`), and its plain twin (`/v1/…`), again
    under `/p/{policy}`: the same handler, with the path's policy confining the caller (proxy/auth.py). A router
    of its own, built per app: the modules' routers are shared by every app built in a process."""
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    bound = {r.path for r in routes if r.path.startswith("/s/")}
    plain = {path.removeprefix(prefix) for path in bound for prefix in SESSION_PREFIXES if path.startswith(prefix)}
    prefixed = APIRouter()
    for route in routes:
        if route.path in bound | plain:
            prefixed.add_api_route(
                POLICY_PREFIX + route.path, route.endpoint, methods=sorted(route.methods or ()),
                response_model=route.response_model, status_code=route.status_code, responses=route.responses,
                summary=route.summary, description=route.description, name=f"{route.name}_in_policy",
                response_class=route.response_class, include_in_schema=route.include_in_schema,
                dependencies=route.dependencies, openapi_extra=route.openapi_extra)
    return prefixed


def build_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        # What is loaded by now (transformers, the tokenizer, templates, routes: ~340k objects) lives as
        # long as the process. Frozen, the collector's full passes skip it instead of walking all of it.
        gc.freeze()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="tracetrain gateway", lifespan=lifespan, dependencies=[Depends(check_path_ids)])
    app.state.gateway = gateway
    install_error_handlers(app)
    install_openapi(app)
    routers = [module.router for module in (chat, messages, responses, completions, rewards, sessions, corrections,
                                            audit, stats, system, policies, replicas, generation, console)]
    for router in routers:
        app.include_router(router)
    app.include_router(policy_paths(routers))
    mount_console(app)
    app.add_middleware(BodyLimit, limit=gateway.config.gateway.max_body_bytes)
    app.add_middleware(InFlight, gateway=gateway)
    return app
