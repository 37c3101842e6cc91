"""Request and response models of the OpenAI Responses API (`POST /v1/responses`), as far as the
gateway reads them, and the translation of input items to the chat-shaped messages the serving core
uses (and back, for output items).

Input items: messages (`input_text`/`output_text` parts), `function_call` and
`function_call_output`. Hosted tools (web search, files, computer use, ...) and other item or part
types (images, files, reasoning) are refused with a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tracetrain.proxy.errors import APIError

INSTRUCTIONS = "instructions"
"""Marks the system message that came from `instructions`: it does not carry over to a chained request."""


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "input": "Say hello.", "max_output_tokens": 16}]})
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=131072)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    stream: bool = False
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: str | None = None


def chat_tools(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    """Function tools as the chat template's tools; hosted tools are refused."""
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        if tool.type != "function" or not tool.name:
            raise APIError(400, f"tools.{index}: '{tool.type}' tools are not supported by this gateway (only "
                           "function tools with a name are).", code="unsupported_tool", param=f"tools.{index}")
        function = {"name": tool.name, **({"description": tool.description} if tool.description else {}),
                    "parameters": tool.parameters or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": function})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts.", code="invalid_value",
                       param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content.{j}: '{kind}' parts are not supported by this gateway "
                           "(input_text and output_text are).", code="unsupported_content",
                           param=f"{where}.content.{j}")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]], known_calls: set[str]) -> list[dict[str, Any]]:
    """Input items as chat-shaped messages. A `function_call` joins the assistant message right
    before it (a reply with text and calls comes back as a message item and call items);
    `function_call_output` must answer a call made earlier in the conversation (`known_calls` grows)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer.",
                               code="invalid_value", param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs string call_id, name and arguments.",
                               code="invalid_value", param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            known_calls.add(item["call_id"])
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                out[-1]["content"] = out[-1]["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                raise APIError(400, f"{where}: function_call_output for '{call_id}', which no earlier function_call "
                               "in this conversation has.", code="unknown_call_id", param=f"{where}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise APIError(400, f"{where}: '{kind}' items are not supported by this gateway (message, "
                           "function_call and function_call_output are).", code="unsupported_item", param=where)
    return out


def output_items(reply: dict[str, Any], response_id: str, status: str = "completed") -> list[dict[str, Any]]:
    """A canonical assistant reply as Responses output items: a message (if it has text), then calls.
    Ids derive from the response's, so reading a response back gives the same items."""
    items: list[dict[str, Any]] = []
    if reply.get("content"):
        items.append({"type": "message", "id": f"msg_{response_id.removeprefix('resp_')}", "status": status,
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": reply["content"], "annotations": []}]})
    for call in reply.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items
