"""Request and response models of the OpenAI chat API, as far as the gateway reads them.

Unknown fields are accepted and ignored (clients send many); known fields are type-checked. The models are
the one statement of what a request may hold: `/openapi.json` is generated from them, so whatever the
document allows validates, and what validation refuses the document leaves out (tests/integration/
test_fuzz_openapi.py holds them to it). Where the gateway leaves something out on purpose (image parts,
penalties its engines are not given), a validator says so by name (`errors.refusal`) instead of a type error.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from tracetrain.proxy.binding import BindingId
from tracetrain.proxy.errors import refusal


class RequestModel(BaseModel):
    """A request body's model, or a part of one: strict, so that what validates is what the document (generated
    from the models) says, and nothing else: `0` is no boolean and `"16"` no number here, as in JSON Schema."""

    model_config = ConfigDict(strict=True)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral)
"""For an integer of a request body, after its bounds (`Annotated[int, Field(ge=…), INTEGRAL]`: before them,
pydantic would write the bounds into the document as `ge`/`le`, which JSON Schema does not know): in JSON
Schema `16.0` is an integer too (fuzzers send it), so it is taken as 16; a string or a boolean is not."""


def neutral_only(neutral: str, *, boolean: bool = False) -> WrapValidator:
    """For a parameter the engines are not given (engines/base.py's `SamplingParams` has no field for it): the
    field's type admits only its neutral value, and anything else is refused by name, never ignored. `boolean`:
    the neutral value is `false`."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        try:
            # `false == 0` to Python, not to JSON Schema: `const: 0` takes no boolean, `const: false` no number.
            if value is not None and isinstance(value, bool) != boolean:
                raise ValueError(value)
            return handler(value)
        except (ValidationError, ValueError):
            raise refusal("unsupported_parameter", f"'{info.field_name}' is not supported by this gateway: its "
                          f"engines are not given it, so only {neutral} is accepted (or leave it out).") from None

    return WrapValidator(check)


class TextPart(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


def _text_part(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise refusal("unsupported_content", f"content parts of type {kind!r} are not supported; only "
                          "text parts ({'type': 'text', 'text': ...}) reach the model.") from None
        raise


TextContent = str | list[Annotated[TextPart, WrapValidator(_text_part)]]
"""Text, or text parts: any other part (image, audio, file) is refused by name, since the prompt would lose it."""


class _Message(RequestModel):
    model_config = ConfigDict(extra="allow")
    content: TextContent | None = None
    name: str | None = None


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class FunctionCall(RequestModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any]
    """A JSON object as text (OpenAI's spelling), or the object itself; rendered the same."""


class ToolCall(RequestModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Message):
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str
    """The id of a tool call of an earlier assistant message (checked by `message_problem`)."""


class FunctionMessage(_Message):
    role: Literal["function"]


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
                        Field(discriminator="role")]


def message_problem(messages: list[ChatMessage]) -> tuple[str, str, str] | None:
    """(param, message, code) of a `tool` message whose `tool_call_id` no earlier assistant message's
    `tool_calls` has, as OpenAI refuses it: a rule across messages, which no JSON Schema can state. None when
    every message can be rendered."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        if isinstance(message, AssistantMessage):
            called.update(call.id for call in message.tool_calls or [])
        elif isinstance(message, ToolMessage) and message.tool_call_id not in called:
            return (f"messages.{index}.tool_call_id", f"messages.{index}: a 'tool' message for "
                    f"'{message.tool_call_id}', which no earlier assistant message's tool_calls has.",
                    "unknown_tool_call_id")
    return None


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""A 64-bit signed seed, as OpenAI's API and vLLM take it. Beyond it the in-process engine's generator
cannot be seeded (that was a 502); inside it, the seed of each choice (seed + index) still is."""


class StreamOptions(RequestModel):
    include_usage: bool = False


class FunctionDefinition(RequestModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    """A function tool. Checked as this model, rendered as sent (`as_sent`): the chat template renders the
    client's own dict, and a reordered key would change the prompt."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition
    _sent: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_as_sent(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> ChatTool:
        tool: ChatTool = handler(data)
        tool._sent = data if isinstance(data, dict) else tool.model_dump(exclude_unset=True)
        return tool

    @property
    def as_sent(self) -> dict[str, Any]:
        return self._sent


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(RequestModel):
    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")]


class Metadata(RequestModel):
    """String values; `session_id` and `group_id` bind the call (docs/api.md)."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, str] = Field(init=False)
    session_id: BindingId | None = None
    group_id: BindingId | None = None


NO_PENALTY = "0"


class UnappliedPenalties(RequestModel):
    """OpenAI's penalties and logit bias, which this gateway's engines are not given: refused by name
    unless neutral, never silently ignored (Chat Completions and Completions alike)."""

    frequency_penalty: Annotated[Literal[0] | None, neutral_only(NO_PENALTY)] = Field(
        default=None, description="Not applied by this gateway's engines: only 0 is accepted.")
    presence_penalty: Annotated[Literal[0] | None, neutral_only(NO_PENALTY)] = Field(
        default=None, description="Not applied by this gateway's engines: only 0 is accepted.")
    logit_bias: Annotated[dict[str, float] | None, Field(max_length=0), neutral_only("an empty map")] = Field(
        default=None, description="Not applied by this gateway's engines: only an empty map is accepted.")


class ChatCompletionRequest(UnappliedPenalties):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}]})
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=16), INTEGRAL] = 1
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: Annotated[int, Field(ge=1, le=131072), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=131072), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), INTEGRAL] | None = None
    top_k: Annotated[Literal[-1, 0] | None, neutral_only("-1 or 0 (no top-k cut)")] = Field(
        default=None, description="vLLM's extension; not applied by this gateway's engines: only -1 or 0 (no "
        "top-k cut) is accepted.")
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(default=None, description=(
        "`false`: a reply holds at most its first tool call, as vLLM answers."))
    response_format: ResponseFormat | None = None
    user: BindingId | None = None
    metadata: Metadata | None = None

    def functions(self) -> dict[str, dict[str, Any] | None]:
        """The tools' functions: name -> parameter schema."""
        return {t.function.name: t.function.parameters for t in self.tools or []}


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


class SessionRewardRequest(RequestModel):
    """A reward on a session path (`/s/{session}/v1/rewards`): the path names the session."""

    model_config = ConfigDict(extra="forbid")
    session_id: str | None = None
    """Optional here (the path names the session); empty names none."""
    completion_id: str | None = None
    """A `chatcmpl-…` id; the reward then targets that call (and its session)."""
    choice_index: Annotated[int, Field(ge=0), INTEGRAL] = 0
    """With `completion_id`: which choice of an `n>1` request the reward is for."""
    reward: float | Annotated[dict[str, float], Field(min_length=1)]
    """A finite number, or named components (at least one) combined by the configured weights."""
    final: bool = False
    idempotency_key: str | None = Field(default=None, max_length=256)

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | dict[str, float]) -> float | dict[str, float]:
        values = value.values() if isinstance(value, dict) else [value]
        if any(not math.isfinite(v) for v in values):
            raise ValueError("reward must be a finite number (no NaN or infinity)")
        return value


class SessionReward(SessionRewardRequest):
    """A reward that names its session."""

    session_id: str = Field(min_length=1)


class CallReward(SessionRewardRequest):
    """A reward that names its call (and so its session)."""

    completion_id: str


def _names_a_target(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, dict) and not value.get("session_id") and value.get("completion_id") is None:
            raise refusal("missing_target", "Give a session_id or a completion_id.") from None
        raise


RewardRequest = Annotated[SessionReward | CallReward, WrapValidator(_names_a_target)]
"""A reward on `/v1/rewards`: it names its session, its call, or both (the document's `anyOf` of the two)."""


class RewardResponse(BaseModel):
    id: int
    session_id: str
    call_id: str | None
    value: float
    final: bool
    duplicate: bool = False
    """True when the idempotency key was seen before with the same payload: nothing new was stored."""
