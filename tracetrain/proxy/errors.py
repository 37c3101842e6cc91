"""Every error leaves the gateway in its API's shape: OpenAI's {"error": {"message", "type", "code",
"param"}}, or Anthropic's {"type": "error", "error": {"type", "message"}} on the Messages API."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import PydanticCustomError
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from tracetrain.engines.base import EngineError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


class BodyTooLarge(StarletteHTTPException):
    """A body that grew past the limit while streaming in (chunked, no Content-Length). An HTTPException,
    because FastAPI turns any other exception raised while it reads the body into a 400."""

    code = "body_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body exceeds {limit} bytes.")


STORE_ERRORS = (OperationalError, InterfaceError, PoolTimeout)
"""The store cannot answer just now: PostgreSQL restarting or unreachable, a full disk, a lock held past
the timeout, no pooled connection free. Not IntegrityError and the like: those are about the request."""


def store_error(exc: Exception) -> APIError:
    """A store failure as the 503 the client sees, in OpenAI's error shape, with Retry-After: code
    `store_full` when the store's disk is full (SQLite's SQLITE_FULL, PostgreSQL's 53100 disk_full),
    else `store_unavailable`. A full disk is a 503 too, not WebDAV's 507: every OpenAI client and load
    balancer retries a 503 without special cases, and the code says which it is. The request was not
    acknowledged, so the client may send it again (a commit whose answer the lost connection swallowed
    may still be in the store: a reward's idempotency key makes its retry safe). The database's own
    words go to the log only: they name hosts and paths."""
    orig = getattr(exc, "orig", None) or exc
    detail = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    full = getattr(orig, "sqlstate", None) == "53100" or any(
        words in detail.lower() for words in ("disk is full", "no space left on device"))
    log.warning("store error, answered 503: %s: %s", type(orig).__name__, detail)
    if full:
        return APIError(503, "The store's disk is full: nothing was recorded. Retry later.",
                        code="store_full", headers={"Retry-After": "5"})
    return APIError(503, "The store is unavailable: nothing was recorded. Retry shortly.",
                    code="store_unavailable", headers={"Retry-After": "1"})


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


REFUSALS = frozenset({"unsupported_content", "unsupported_parameter", "unsupported_tool", "unsupported_item",
                      "missing_target", "invalid_value", "full_weight_policy"})
"""Codes of validation errors the request models raise themselves (`refusal`): what the document leaves out on
purpose (image parts, penalties the engines are not given, hosted tools), refused with a message that names it
rather than as a type error, rules a model states in its schema by hand (a reward's target, a policy's LoRA-only
training), and a type error a union would otherwise report from the wrong alternative (several prompts)."""


def refusal(code: str, message: str) -> PydanticCustomError:
    """A validation error with the gateway's own code (one of `REFUSALS`), raised from a model's validator: the
    model's schema states what is accepted, this says why the rest is not. `message` is used as it is."""
    assert code in REFUSALS, code
    return PydanticCustomError(code, message)  # without a context the message is not a template


FIELD_CODES = {"tools": "invalid_tools", "tool_choice": "invalid_tool_choice",
               "response_format": "invalid_response_format"}
"""Error codes for fields whose shape has its own code in OpenAI's errors; other fields: invalid_value."""


def _place(loc: list[Any], body: Any, missing: bool) -> list[str]:
    """The parts of an error's location that are places in the body: pydantic also names the union member it
    tried there (`str`, `list[...]`, `NamedToolChoice`, a discriminator's value such as `user`), which is not.
    `missing`: the error is a required field the body lacks, the location's last part."""
    place, node = [], body
    for part in loc:
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int):
            place.append(str(part))
            node = node[part] if isinstance(node, dict) or part < len(node) else None
    if missing and loc:
        place.append(str(loc[-1]))
    return place


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of the most specific validation error; its param is where in the body it is."""
    errors = exc.errors()
    refused = next((e for e in errors if e.get("type") in REFUSALS), None)
    # Of a union's failed alternatives the deepest is the one the client meant (a block with a missing
    # field, rather than "should be a string").
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
    if first.get("type") == "json_invalid":
        return f"Request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json"
    if refused is not None:  # a refusal names what it refuses: it wins over a union's other alternatives
        first = refused
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = _place(loc[1:], exc.body, first.get("type") == "missing")
    else:
        loc = [str(p) for p in loc[1:]] if loc and loc[0] in ("query", "path", "header") else [str(p) for p in loc]
    where = ".".join(loc) or "body"
    if refused is not None:
        return (f"{where}: {refused['msg']}", where, refused["type"]) if loc else (refused["msg"], None,
                                                                                 refused["type"])
    code = FIELD_CODES.get(loc[0], "invalid_value") if loc else "invalid_value"
    return f"Invalid value for '{where}': {first.get('msg', 'invalid')}", where, code


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                   529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
"""Path endings of the Anthropic Messages API, whose errors come in Anthropic's shape."""


def error_for_path(path: str, status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """Each API's errors in its own shape: Anthropic's for the Messages API, OpenAI's otherwise."""
    if path.endswith(MESSAGES_PATHS):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return error_response(status, message, code, param, headers)


def _respond(request: Request, status: int, message: str, code: str, param: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    return error_for_path(request.url.path, status, message, code, param, headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _respond(request, exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return _respond(request, exc.status, str(exc), exc.code, headers=getattr(exc, "headers", None))

    async def _store(request: Request, exc: Exception) -> JSONResponse:
        error = store_error(exc)
        return _respond(request, error.status, error.message, error.code, headers=error.headers)

    for kind in STORE_ERRORS:
        app.add_exception_handler(kind, _store)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe_validation(exc)
        return _respond(request, 400, message, code, param)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return _respond(request, 400, f"Request body is not valid JSON: {exc}", "invalid_json")

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return _respond(request, 413, exc.detail, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route with this path only; a path may have several
            # (POST and DELETE of a reward override), and RFC 9110 wants them all.
            headers["Allow"] = allowed_methods(request)
        return _respond(request, exc.status_code, str(exc.detail), "http_error", headers=headers or None)


def _routes(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    for route in routes:
        included = getattr(route, "original_router", None)  # newer FastAPI keeps an included router whole
        yield from _routes(included.routes) if included is not None else (route,)


def allowed_methods(request: Request) -> str:
    """The `Allow` header of a 405: every method of every route whose path matches the request's (the routers
    are included without a prefix, so a route's own path is the app's)."""
    methods: set[str] = set()
    for route in _routes(request.app.router.routes):
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route_methods
    return ", ".join(sorted(methods))
