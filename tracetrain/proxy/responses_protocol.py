"""Request and response models of the OpenAI Responses API (`POST /v1/responses`), as far as the
gateway reads them, and the translation of input items to the chat-shaped messages the serving core
uses (and back, for output items).

Input items: messages (`input_text`/`output_text` parts), `function_call` and
`function_call_output`. Hosted tools (web search, files, computer use, ...) and other item or part
types (images, files, reasoning) are left out of the models (the OpenAPI document is generated from them)
and refused with a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from tracetrain.proxy.binding import BindingId
from tracetrain.proxy.errors import APIError, refusal
from tracetrain.proxy.protocol import INTEGRAL, Metadata, RequestModel
from tracetrain.proxy.render import cut_call

INSTRUCTIONS = "instructions"
"""Marks the system message that came from `instructions`: it does not carry over to a chained request."""


def _named(kinds: str, what: str, accepted: str, known: tuple[str, ...]) -> WrapValidator:
    """Refuses an item of another `type` than `known` by name (code `kinds`), rather than as a type error."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            kind = value.get("type", "message") if isinstance(value, dict) else None
            if isinstance(kind, str) and kind not in known:
                raise refusal(kinds, f"'{kind}' {what} are not supported by this gateway ({accepted}).") from None
            raise

    return WrapValidator(check)


class FunctionTool(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Tool = Annotated[FunctionTool, _named("unsupported_tool", "tools", "only function tools are", ("function",))]


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormatText(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]


class TextFormatJSONObject(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["json_object"]


class TextFormatJSONSchema(RequestModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")
    name: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(RequestModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class TextPart(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text", "text"]
    text: str


TEXT_PARTS = ("input_text", "output_text", "text")
Part = Annotated[TextPart, _named("unsupported_content", "parts", "input_text and output_text are", TEXT_PARTS)]


class MessageItem(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part] = ""


class FunctionCallItem(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    """A `call_id` of an earlier `function_call` in the conversation (checked by `input_messages`)."""
    output: Any = None
    """Text, or any JSON (given to the model as its JSON text)."""


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


ITEMS = ("message", "function_call", "function_call_output")
InputItem = Annotated[
    Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
              | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)],
    _named("unsupported_item", "items", "message, function_call and function_call_output are", ITEMS)]
"""An input item; a message may leave out its `type`."""


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "input": "Say hello.", "max_output_tokens": 16}]})
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=131072), INTEGRAL] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    previous_response_id: str | None = None
    store: bool = True
    metadata: Metadata | None = None
    stream: bool = False
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: BindingId | None = None


def chat_tools(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    """Function tools as the chat template's tools."""
    if not tools:
        return None
    out = []
    for tool in tools:
        function = {"name": tool.name, **({"description": tool.description} if tool.description else {}),
                    "parameters": tool.parameters or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": function})
    return out


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(items: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem],
                   known_calls: set[str]) -> list[dict[str, Any]]:
    """Input items as chat-shaped messages. A `function_call` joins the assistant message right
    before it (a reply with text and calls comes back as a message item and call items);
    `function_call_output` must answer a call made earlier in the conversation (`known_calls` grows)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            known_calls.add(item.call_id)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                out[-1]["content"] = out[-1]["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item.call_id not in known_calls:  # a rule across items: no JSON Schema states it
                raise APIError(400, f"input.{i}: function_call_output for '{item.call_id}', which no earlier "
                               "function_call in this conversation has.", code="unknown_call_id",
                               param=f"input.{i}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": item.output if isinstance(item.output, str) else json.dumps(item.output)})
    return out


def output_items(reply: dict[str, Any], response_id: str, status: str = "completed") -> list[dict[str, Any]]:
    """A canonical assistant reply as Responses output items: a message (if it has text), then calls (a call
    cut short by the token limit `incomplete`, with the arguments generated so far). The message is
    `incomplete` when the response is (`status`) and has no calls: its text is what the limit cut. Ids derive
    from the response's, so reading a response back gives the same items."""
    items: list[dict[str, Any]] = []
    if reply.get("content"):
        cut_text = status == "incomplete" and not reply.get("tool_calls")
        items.append({"type": "message", "id": f"msg_{response_id.removeprefix('resp_')}",
                      "status": "incomplete" if cut_text else "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": reply["content"], "annotations": []}]})
    for call in reply.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "incomplete" if cut_call(call) else "completed"})
    return items
