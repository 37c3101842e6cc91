"""Request and response models of the Anthropic Messages API (`POST /v1/messages`, `POST
/v1/messages/count_tokens`), as far as the gateway reads them, and their translation to the canonical chat
messages the serving core uses.

Unknown fields are accepted and ignored. The models are the one statement of what a request may hold (the
OpenAPI document is generated from them): content blocks the gateway cannot give the model (images,
documents, thinking) are left out of them and refused with a 400 naming the block, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator

from tracetrain.proxy.binding import BindingId
from tracetrain.proxy.errors import APIError, refusal
from tracetrain.proxy.protocol import INTEGRAL, RequestModel, neutral_only


class TextBlock(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


KNOWN_BLOCKS = ("text", "tool_use", "tool_result")


def _block(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A block of a type the gateway does not take (image, document, thinking, ...) is refused by name."""
    try:
        return handler(value)
    except ValidationError:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in KNOWN_BLOCKS:
            raise refusal("unsupported_content", f"'{kind}' blocks are not supported by this gateway "
                          "(text, tool_use and tool_result are).") from None
        raise


UserBlock = Annotated[Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")], WrapValidator(_block)]
AssistantBlock = Annotated[Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")], WrapValidator(_block)]


class UserMessage(RequestModel):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class Tool(RequestModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class Metadata(RequestModel):
    """`user_id`, `session_id` and `group_id` bind the call (docs/api.md)."""

    model_config = ConfigDict(extra="allow")
    user_id: BindingId | None = None
    session_id: BindingId | None = None
    group_id: BindingId | None = None


class CountTokensRequest(RequestModel):
    """What makes the prompt: a Messages request's fields that are rendered, and all that `count_tokens` takes."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hello."}]}]})
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}]})
    max_tokens: Annotated[int, Field(ge=1, le=131072), INTEGRAL]
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Annotated[Literal[-1, 0] | None, neutral_only("-1 or 0 (no top-k cut)")] = Field(
        default=None, description="Not applied by this gateway's engines: only -1 or 0 (no top-k cut) is accepted.")
    stream: bool = False
    metadata: Metadata | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int
    """The prompt's tokens, as a Messages call with the same fields would send to the engine."""


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    """`text` and `tool_use` blocks."""
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def canonical_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """System, then each message: a user message's tool results become `tool` messages (in order,
    before its text); an assistant message's tool_use blocks become its tool calls."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system)})
    called: set[str] = set()
    for index, message in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        text, calls = "", []
        for block in blocks:
            if isinstance(block, TextBlock):
                text += block.text
            elif isinstance(block, ToolUseBlock):
                called.add(block.id)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif block.tool_use_id not in called:  # a rule across messages: no JSON Schema states it
                raise APIError(400, f"messages.{index}: tool_result for '{block.tool_use_id}', which no earlier "
                               "assistant tool_use has.", code="unknown_tool_use_id", param=f"messages.{index}")
            else:
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or message.role == "assistant" or not out or out[-1]["role"] != "tool":
            out.append({"role": message.role, "content": text})
    return out


def chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools as the chat template's function tools (Anthropic-only fields such as
    `cache_control` are not shown to the model)."""
    if not tools:
        return None
    functions = [{"name": t.name, **({"description": t.description} if t.description is not None else {}),
                  "parameters": t.input_schema} for t in tools]
    return [{"type": "function", "function": f} for f in functions]
