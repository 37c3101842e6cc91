"""The gateway's OpenAPI document, corrected to describe what it really does.

FastAPI documents 422 for invalid requests, but the gateway answers 400 in its API's error shape
(proxy/errors.py); and the session-bound paths (`/s/{session}/g/{group}/v1/…`) share one handler with
the plain paths, so their path parameters are not in the handler's signature. Both are fixed here,
once, so that generated clients and fuzzers see the real contract.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tracetrain.proxy.binding import MAX_ID_LEN

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"},
        "param": {"type": ["string", "null"]}}}},
}
"""OpenAI's error shape (the Messages API answers in Anthropic's; its paths say so)."""
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                         "properties": {"type": {"type": "string"},
                                                                        "message": {"type": "string"}}}},
}


def _error(path: str, description: str) -> dict[str, Any]:
    name = "AnthropicError" if path.endswith("/v1/messages") else "Error"
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


ERROR_DESCRIPTIONS = {401: "Missing or wrong API key", 403: "Not allowed for this API key",
                      404: "No such session"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Documented error answers of an OpenAI-shaped route, for its decorator's `responses=`."""
    return {status: {"description": ERROR_DESCRIPTIONS[status],
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for status in statuses}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(
        {"Error": ERROR_SCHEMA, "AnthropicError": ANTHROPIC_ERROR_SCHEMA})
    schema["components"]["schemas"].pop("HTTPValidationError", None)
    schema["components"]["schemas"].pop("ValidationError", None)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            for name in re.findall(r"{(\w+)}", path):
                if name not in declared:
                    operation.setdefault("parameters", []).append({
                        "name": name, "in": "path", "required": True,
                        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LEN}})
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses.setdefault("400", _error(path, "Invalid request"))
            if operation.get("requestBody") or path.startswith("/s/"):
                responses.setdefault("401", _error(path, "Missing or wrong API key"))
    return schema


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
