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


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]},
                       "arguments": parameters or {"type": "object", "properties": {}}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call(functions: dict[str, dict[str, Any] | None], choice: str | None) -> Constraint | None:
    """A forced tool call: `choice` is `required` (any of `functions`, name -> parameter schema), a
    function's name, or None / `auto` / `none` for a model that may answer freely."""
    if choice is None or choice in ("auto", "none"):
        return None
    if not functions:
        raise APIError(400, "tool_choice requires 'tools'.", param="tool_choice", code="invalid_tool_choice")
    if choice != "required" and choice not in functions:
        raise APIError(400, f"tool_choice names '{choice}', which is not among the tools.", param="tool_choice",
                       code="invalid_tool_choice")
    chosen = functions if choice == "required" else {choice: functions[choice]}
    schemas = [_call_schema(name, parameters) for name, parameters in chosen.items()]
    return Constraint({"json": schemas[0] if len(schemas) == 1 else {"anyOf": schemas}}, forced_prefix=TOOL_CALL_PREFIX)


def json_output(schema: dict[str, Any] | None) -> Constraint:
    """Output constrained to a JSON object, or to `schema`."""
    return Constraint({"json_object": True} if schema is None else {"json": schema})
