"""Request and response models of the OpenAI chat API, as far as the gateway reads them.

Unknown fields are accepted and ignored (clients send many); known fields are type-checked.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


def message_problem(messages: list[ChatMessage]) -> tuple[str, str, str] | None:
    """(param, message, code) of the first message the gateway must refuse, as OpenAI would or because
    the model cannot see it: a content part that is not text (images, audio, files: the prompt would
    silently lose them), or a `tool` message whose `tool_call_id` no earlier assistant message's
    `tool_calls` has. None when every message can be rendered."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        for part_index, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                where = f"messages.{index}.content.{part_index}"
                text = (f"{where}: content parts of type {part.get('type')!r} are not supported; only text parts "
                        "({'type': 'text', 'text': ...}) reach the model.")
                return where, text, "unsupported_content"
        if message.role == "assistant":
            called.update(str(call.get("id")) for call in message.tool_calls or [])
        elif message.role == "tool" and message.tool_call_id not in called:
            return (f"messages.{index}.tool_call_id", f"messages.{index}: a 'tool' message for "
                    f"'{message.tool_call_id}', which no earlier assistant message's tool_calls has.",
                    "unknown_tool_call_id")
    return None


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""A 64-bit signed seed, as OpenAI's API and vLLM take it. Beyond it the in-process engine's generator
cannot be seeded (that was a 502); inside it, the seed of each choice (seed + index) still is."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")]


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}]})
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=131072)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=131072)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    tools: list[dict[str, Any]] | None = None
    """Checked against `ChatTool`, kept as sent: the chat template renders them, and a reordered key
    would change the prompt."""
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @field_validator("tools")
    @classmethod
    def _tool_shapes(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in value or []:
            ChatTool.model_validate(tool)
        return value

    def functions(self) -> dict[str, dict[str, Any] | None]:
        """The tools' functions: name -> parameter schema."""
        tools = [ChatTool.model_validate(t) for t in self.tools or []]
        return {t.function.name: t.function.parameters for t in tools}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatCompletionChoice(BaseModel):
    index: int
    message: dict[str, Any]
    """The assistant message: `content` and/or `tool_calls`."""
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    policy_version: int
    """The policy version that produced the reply (also in the `X-Policy-Version` header)."""
    session_id: str


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str | None = None
    completion_id: str | None = None
    """A `chatcmpl-…` id; the reward then targets that call (and its session)."""
    choice_index: int = Field(default=0, ge=0)
    """With `completion_id`: which choice of an `n>1` request the reward is for."""
    reward: float | dict[str, float]
    final: bool = False
    idempotency_key: str | None = Field(default=None, max_length=256)

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | dict[str, float]) -> float | dict[str, float]:
        values = value.values() if isinstance(value, dict) else [value]
        if isinstance(value, dict) and not value:
            raise ValueError("reward components must not be empty")
        if any(not math.isfinite(v) for v in values):
            raise ValueError("reward must be a finite number (no NaN or infinity)")
        return value


class RewardResponse(BaseModel):
    id: int
    session_id: str
    call_id: str | None
    value: float
    final: bool
    duplicate: bool = False
    """True when the idempotency key was seen before with the same payload: nothing new was stored."""
