"""One tool-call turn through each API's real SDK, streamed or not, and the message an agent sends back.

Each `ask_*` makes one call and returns a `Turn`: what the reply said about its tool calls (one unless
`calls` says how many), and the reply as that SDK's agents put it back into the conversation. Shared by the
scripted-engine and vLLM tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anthropic
from openai import OpenAI

LOOKUP: Any = {"type": "function", "function": {
    "name": "lookup", "description": "Look an item up.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}
ADD: Any = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
QUESTION = "Look up the item called Item-1153 for me, with its full description."


@dataclass
class Call:
    id: str
    name: str
    arguments: Any
    """The arguments string (OpenAI APIs) or the input object (Anthropic)."""
    status: str | None = None
    """Responses: the function_call item's status."""


@dataclass
class Turn:
    stop: str
    """finish_reason, the response's status, or stop_reason."""
    calls: list[Call]
    incomplete: dict[str, Any] | None
    """Responses: incomplete_details."""
    content: str
    echo: list[dict[str, Any]]
    """The reply as the agent sends it back (messages, items or an assistant message)."""

    @property
    def call_id(self) -> str:
        return self.calls[0].id

    @property
    def name(self) -> str:
        return self.calls[0].name

    @property
    def arguments(self) -> Any:
        return self.calls[0].arguments

    @property
    def call_status(self) -> str | None:
        return self.calls[0].status


def _counted(calls: list[Call], expected: int, reply: Any) -> list[Call]:
    assert len(calls) == expected, reply
    return calls


def ask_chat(client: OpenAI, model: str, messages: list[dict[str, Any]], *, stream: bool, max_tokens: int,
             tools: list[Any], tool_choice: Any = None, calls: int = 1) -> Turn:
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=max_tokens,
                                               **extra)
        choice = reply.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        finish = choice.finish_reason
    else:
        content, streamed, finish = "", {}, ""
        for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, stream=True,
                                                    max_tokens=max_tokens, **extra):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:  # accumulated by index, as SDK helpers do
                into = streamed.setdefault(call.index, {"id": "", "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                into["id"] += call.id or ""
                into["function"]["name"] += call.function.name or "" if call.function else ""
                into["function"]["arguments"] += call.function.arguments or "" if call.function else ""
            finish = chunk.choices[0].finish_reason or finish
        message = {"role": "assistant", "content": content or None, "tool_calls": list(streamed.values())}
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)  # as the SDK's own message has none
    made = [Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return Turn(str(finish), _counted(made, calls, message), None, message.get("content") or "", [message])


def ask_responses(client: OpenAI, model: str, items: list[dict[str, Any]], *, stream: bool, max_tokens: int,
                  tools: list[Any], tool_choice: Any = None, calls: int = 1) -> Turn:
    functions = [{"type": "function", **tool["function"]} for tool in tools]
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    if not stream:
        response = client.responses.create(model=model, input=items, tools=functions,  # type: ignore[arg-type]
                                           max_output_tokens=max_tokens, **extra)
    else:
        events = list(client.responses.create(model=model, input=items, tools=functions,  # type: ignore[arg-type]
                                              max_output_tokens=max_tokens, stream=True, **extra))
        response = events[-1].response  # type: ignore[union-attr]
        assert events[-1].type == f"response.{response.status}"
    output = [item.model_dump(exclude_none=True) for item in response.output]
    made = [Call(item["call_id"], item["name"], item["arguments"], item["status"])
            for item in output if item["type"] == "function_call"]
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    details = response.incomplete_details.model_dump() if response.incomplete_details else None
    return Turn(response.status or "", _counted(made, calls, output), details, text, output)


def ask_messages(client: anthropic.Anthropic, model: str, messages: list[dict[str, Any]], *, stream: bool,
                 max_tokens: int, tools: list[Any], tool_choice: Any = None, calls: int = 1) -> Turn:
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in tools]
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    if not stream:
        message = client.messages.create(model=model, messages=messages, tools=anthropic_tools,  # type: ignore
                                         max_tokens=max_tokens, **extra)
    else:
        with client.messages.stream(model=model, messages=messages, tools=anthropic_tools,  # type: ignore
                                    max_tokens=max_tokens, **extra) as events:
            message = events.get_final_message()
    made = [Call(block.id, block.name, block.input) for block in message.content if block.type == "tool_use"]
    text = "".join(block.text for block in message.content if block.type == "text")
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    return Turn(str(message.stop_reason), _counted(made, calls, message), None, text,
                [{"role": "assistant", "content": blocks}])


def tool_result(api: str, turn: Turn, result: str) -> list[dict[str, Any]]:
    """What an agent adds after running (or refusing) the turn's calls, each answered `result`, in the API's
    shape."""
    if api == "chat":
        return [{"role": "tool", "tool_call_id": call.id, "content": result} for call in turn.calls]
    if api == "responses":
        return [{"type": "function_call_output", "call_id": call.id, "output": result} for call in turn.calls]
    return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}
                                         for call in turn.calls]}]


def with_arguments(api: str, echo: list[dict[str, Any]], arguments: Any) -> list[dict[str, Any]]:
    """`echo` with its call's arguments replaced (repaired or dropped by the agent): a string, or for the
    Anthropic API an object."""
    out = json.loads(json.dumps(echo))
    for entry in out:
        if api == "chat":
            for call in entry.get("tool_calls") or []:
                call["function"]["arguments"] = arguments
        elif api == "responses" and entry.get("type") == "function_call":
            entry["arguments"] = arguments
        elif api == "messages":
            for block in entry["content"]:
                if block["type"] == "tool_use":
                    block["input"] = arguments
    return out
