"""`tool_choice` and `response_format`, enforced by constrained decoding instead of hoped for.

A forced tool call (`tool_choice: "required"` or a named function) appends the Hermes opener
`<tool_call>\\n` to the prompt and constrains the sampled text to the JSON object
`{"name": <one of the allowed tools>, "arguments": <that tool's parameter schema>}`; the grammar then
ends the turn. The opener is prompt, not sample: it is recorded with loss mask 0, since the model did
not choose it. `response_format` maps to a JSON-object or JSON-schema constraint. The constraint is
passed to the engine in vLLM's `structured_outputs` shape; engines without constrained decoding
refuse the request rather than return unconstrained text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracetrain.proxy.errors import APIError
from tracetrain.proxy.render import TOOL_CALL_OPEN

TOOL_CALL_PREFIX = TOOL_CALL_OPEN + "\n"


@dataclass
class Constraint:
    structured_output: dict[str, Any]
    """vLLM `structured_outputs`: `{"json": schema}` or `{"json_object": true}`, plus options."""
    forced_prefix: str = ""
    """Text appended to the prompt before sampling (the tool-call opener for forced calls)."""


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function", tool)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, "Each tool needs a function with a string 'name'.", param="tools", code="invalid_tools")
    return function


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function["name"]]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _forced_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                  ) -> list[dict[str, Any]] | None:
    """The functions one of which must be called, or None when the model may answer freely."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = [_function(t) for t in tools or []]
    if not functions:
        raise APIError(400, "tool_choice requires 'tools'.", param="tool_choice", code="invalid_tool_choice")
    if tool_choice == "required":
        return functions
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}.", param="tool_choice",
                       code="invalid_tool_choice")
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise APIError(400, f"tool_choice names '{name}', which is not among the tools.", param="tool_choice",
                       code="invalid_tool_choice")
    return chosen


def _response_format(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = (response_format or {}).get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs 'json_schema': {'schema': {...}}.",
                           param="response_format", code="invalid_response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type '{kind}' is not one of text, json_object, json_schema.",
                   param="response_format", code="invalid_response_format")


def plan_constraint(*, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                    response_format: dict[str, Any] | None) -> Constraint | None:
    """The constraint a request asks for; a forced tool call wins over `response_format`."""
    forced = _forced_tools(tools, tool_choice)
    if forced is not None:
        schemas = [_call_schema(f) for f in forced]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return Constraint({"json": schema}, forced_prefix=TOOL_CALL_PREFIX)
    structured = _response_format(response_format)
    return None if structured is None else Constraint(structured)
