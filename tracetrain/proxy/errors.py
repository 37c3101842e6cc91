"""Every error leaves the gateway in the OpenAI shape: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracetrain.engines.base import EngineError

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


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


FIELD_CODES = {"tools": "invalid_tools", "tool_choice": "invalid_tool_choice",
               "response_format": "invalid_response_format"}
"""Error codes for fields whose shape has its own code in OpenAI's errors; other fields: invalid_value."""


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of the first validation error. Union members pydantic names in the
    location (`literal['none','auto']`, `NamedToolChoice`) are left out of the param."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return f"Request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json"
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(p for p in loc if not (p[:1].isupper() or "[" in p)) or "body"
    code = FIELD_CODES.get(loc[0], "invalid_value") if loc else "invalid_value"
    return f"Invalid value for '{where}': {first.get('msg', 'invalid')}", where, code


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe_validation(exc)
        return error_response(400, message, code, param)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(400, f"Request body is not valid JSON: {exc}", "invalid_json")

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_response(413, exc.detail, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "http_error")
