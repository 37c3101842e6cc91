"""Request and response models of the Anthropic Messages API (`POST /v1/messages`), as far as the
gateway reads them, and their translation to the canonical chat messages the serving core uses.

Unknown fields are accepted and ignored; content blocks the gateway cannot give the model (images,
documents, thinking) are refused with a 400 naming the block, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tracetrain.proxy.errors import APIError


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class OtherBlock(BaseModel):
    """Any other block type (image, document, thinking, ...): accepted by the schema so that the error
    can name it."""

    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _not_a_known_type(cls, value: str) -> str:
        if value in ("text", "tool_use", "tool_result"):
            raise ValueError(f"malformed '{value}' block")
        return value


Block = TextBlock | ToolUseBlock | ToolResultBlock | OtherBlock


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Block, Field(union_mode="left_to_right")]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}]})
    model: str
    max_tokens: int = Field(ge=1, le=131072)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None


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


def _refuse(block: OtherBlock, index: int) -> None:
    raise APIError(400, f"messages.{index}.content: '{block.type}' blocks are not supported by this gateway "
                   "(text, tool_use and tool_result are).", code="unsupported_content", param=f"messages.{index}")


def canonical_messages(body: MessagesRequest) -> list[dict[str, Any]]:
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
            elif isinstance(block, ToolUseBlock) and message.role == "assistant":
                called.add(block.id)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock) and message.role == "user":
                if block.tool_use_id not in called:
                    raise APIError(400, f"messages.{index}: tool_result for '{block.tool_use_id}', which no earlier "
                                   "assistant tool_use has.", code="unknown_tool_use_id", param=f"messages.{index}")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
            elif isinstance(block, OtherBlock):
                _refuse(block, index)
            else:
                raise APIError(400, f"messages.{index}: a {message.role} message cannot hold '{block.type}' blocks.",
                               code="invalid_content", param=f"messages.{index}")
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
