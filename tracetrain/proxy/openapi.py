"""The gateway's OpenAPI document, corrected to describe what it really does.

FastAPI documents 422 for invalid requests, but the gateway answers 400 in its API's error shape
(proxy/errors.py); and the session-bound paths (`/s/{session}/g/{group}/v1/…`) share one handler with
the plain paths, so their path parameters are not in the handler's signature. Both are fixed here,
once, so that generated clients and fuzzers see the real contract; so are the statuses every route may
answer (413 for a body over the limit), and the error shape of the Messages API's paths. Each route
declares its own other answers (`error_responses`, `generation_responses`);
tests/integration/test_fuzz_openapi.py holds the gateway to all of it.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tracetrain.config import DEFAULT_POLICY, POLICY_NAME_PATTERN, POLICY_NAME_RULE
from tracetrain.proxy.binding import ID_CHARACTERS, ID_RULE, MAX_ID_LEN
from tracetrain.proxy.errors import MESSAGES_PATHS

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


SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
                   "data": {"type": "string", "description": "A JSON object; `[DONE]` ends a Chat Completions or "
                                                             "completions stream"}},
}
"""One server-sent event (OpenAPI before 3.2 has a `text/event-stream` schema describe each event)."""


BINDING_PARAMETERS = ("session", "group", "policy")
PATH_ID_DESCRIPTION = f"1 to {MAX_ID_LEN} characters: {ID_RULE}"
"""Session and group ids in a path (proxy/binding.py, whose regex the schema carries)."""


def _error(path: str, description: str) -> dict[str, Any]:
    name = "AnthropicError" if path.endswith(MESSAGES_PATHS) else "Error"
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


ERROR_DESCRIPTIONS = {401: "Missing or wrong API key", 403: "Not allowed for this API key",
                      404: "No such session", 409: "Conflicts with the current state",
                      429: "Too busy for now: retry after `Retry-After` seconds",
                      502: "The engine failed", 503: "The engine is unavailable: retry",
                      504: "The engine did not answer in time"}


def error_responses(*statuses: int, described: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """Documented error answers of a route, for its decorator's `responses=`; `described` overrides the
    generic description of a status (404 of a model, not a session). In OpenAI's error shape: on the
    Messages API's paths `build_openapi` swaps in Anthropic's."""
    descriptions = {**ERROR_DESCRIPTIONS, **(described or {})}
    return {status: {"description": descriptions[status],
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for status in statuses}


def generation_responses(described: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """What a generating route (chat, messages, responses, completions) answers: its JSON body, or server-
    sent events with `stream: true`; another key's session (403), a model the gateway does not serve
    (404), admission or every replica full (429), and the engine failing (502), unavailable (503) or
    too slow (504)."""
    return {200: {"description": "The reply: JSON, or server-sent events when the request sets `stream`",
                  "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}},
            **error_responses(401, 403, 404, 429, 502, 503, 504,
                              described={403: "The session belongs to another API key or policy, or the call "
                                              "names a policy its key or path does not",
                                         404: "No such model", **(described or {})})}


def _policy_parameter() -> dict[str, Any]:
    """`/p/{policy}`: a named policy (config.POLICY_NAME_PATTERN; an unknown one is 404 `policy_not_found`)."""
    return {"name": "policy", "in": "path", "required": True, "example": DEFAULT_POLICY,
            "description": f"A named policy: {POLICY_NAME_RULE}. Confines the call to it (docs/api.md, Policies)",
            "schema": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": POLICY_NAME_PATTERN}}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(
        {"Error": ERROR_SCHEMA, "AnthropicError": ANTHROPIC_ERROR_SCHEMA})
    schema["components"]["schemas"].pop("HTTPValidationError", None)
    schema["components"]["schemas"].pop("ValidationError", None)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            parameters = operation.setdefault("parameters", [])
            declared = {p["name"]: p for p in parameters if p["in"] == "path"}
            for name in re.findall(r"{(\w+)}", path):
                if name in BINDING_PARAMETERS:  # declared by the handler or not, checked by binding.check_path_ids
                    parameters[:] = [p for p in parameters if p is not declared.get(name)]
                    parameters.append(_policy_parameter() if name == "policy" else {
                        "name": name, "in": "path", "required": True, "description": PATH_ID_DESCRIPTION,
                        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LEN,
                                   "pattern": f"^{ID_CHARACTERS}+$"}})
            if not parameters:
                del operation["parameters"]
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses.setdefault("400", _error(path, "Invalid request"))
            if operation.get("requestBody") or path.startswith(("/s/", "/p/")):
                responses.setdefault("401", _error(path, "Missing or wrong API key"))
            if path.startswith("/p/"):  # proxy/auth.py: the path's policy must exist and be open to the key
                responses.setdefault("403", _error(path, "The API key is bound to another policy"))
                responses.setdefault("404", _error(path, "No such policy"))
            if operation.get("requestBody"):
                responses.setdefault("413", _error(path, "Request body too large"))  # app.BodyLimit
            # Any route that reads or writes the store answers 503 while the store is away (errors.store_error).
            responses.setdefault("503", _error(path, "The store (or the engine) is unavailable just now"))
            if path.endswith(MESSAGES_PATHS):  # routes declare OpenAI's shape; this API answers in Anthropic's
                for status, answer in responses.items():
                    if status.startswith(("4", "5")) and "application/json" in answer.get("content", {}):
                        answer["content"]["application/json"]["schema"] = {
                            "$ref": "#/components/schemas/AnthropicError"}
    return schema


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
