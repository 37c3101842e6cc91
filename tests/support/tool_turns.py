"""One tool-call turn through each API's real SDK, streamed or not, and the message an agent sends back.

Each `ask_*` makes one call and returns a `Turn`: what the reply said about its (one) tool call, and the
reply as that SDK's agents put it back into the conversation. Shared by the scripted-engine and vLLM tests.
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
class Turn:
    stop: str
    """finish_reason, the response's status, or stop_reason."""
    call_id: str
    name: str
    arguments: Any
    """The arguments string (OpenAI APIs) or the input object (Anthropic)."""
    call_status: str | None
    """Responses: the function_call item's status."""
    incomplete: dict[str, Any] | None
    """Responses: incomplete_details."""
    content: str
    echo: list[dict[str, Any]]
    """The reply as the agent sends it back (messages, items or an assistant message)."""


def ask_chat(client: OpenAI, model: str, messages: list[dict[str, Any]], *, stream: bool, max_tokens: int,
             tools: list[Any], tool_choice: Any = None) -> Turn:
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=max_tokens,
                                               **extra)
        choice = reply.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        finish = choice.finish_reason
    else:
        content, calls, finish = "", {}, ""
        for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, stream=True,
                                                    max_tokens=max_tokens, **extra):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:  # accumulated by index, as SDK helpers do
                into = calls.setdefault(call.index, {"id": "", "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                into["id"] += call.id or ""
                into["function"]["name"] += call.function.name or "" if call.function else ""
                into["function"]["arguments"] += call.function.arguments or "" if call.function else ""
            finish = chunk.choices[0].finish_reason or finish
        message = {"role": "assistant", "content": content or None, "tool_calls": list(calls.values())}
    (call,) = message.get("tool_calls") or [None]
    assert call is not None, message
    return Turn(str(finish), call["id"], call["function"]["name"], call["function"]["arguments"], None, None,
                message.get("content") or "", [message])


def ask_responses(client: OpenAI, model: str, items: list[dict[str, Any]], *, stream: bool, max_tokens: int,
                  tools: list[Any], tool_choice: Any = None) -> Turn:
    functions = [{"type": "function", **tool["function"]} for tool in tools]
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    if not stream:
        response = client.responses.create(model=model, input=items, tools=functions,  # type: ignore[arg-type]
                                           max_output_tokens=max_tokens, **extra)
    else:
        events = list(client.responses.create(model=model, input=items, tools=functions,  # type: ignore[arg-type]
                                              max_output_tokens=max_tokens, stream=True, **extra))
        response = events[-1].response  # type: ignore[union-attr]
        assert events[-1].type == "response.incomplete"
    output = [item.model_dump(exclude_none=True) for item in response.output]
    (call,) = [item for item in output if item["type"] == "function_call"]
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    details = response.incomplete_details.model_dump() if response.incomplete_details else None
    return Turn(response.status or "", call["call_id"], call["name"], call["arguments"], call["status"], details,
                text, output)


def ask_messages(client: anthropic.Anthropic, model: str, messages: list[dict[str, Any]], *, stream: bool,
                 max_tokens: int, tools: list[Any], tool_choice: Any = None) -> Turn:
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
    (use,) = [block for block in message.content if block.type == "tool_use"]
    text = "".join(block.text for block in message.content if block.type == "text")
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    return Turn(str(message.stop_reason), use.id, use.name, use.input, None, None, text,
                [{"role": "assistant", "content": blocks}])


def tool_result(api: str, turn: Turn, result: str) -> list[dict[str, Any]]:
    """What an agent adds after running (or refusing) the call, in the API's shape."""
    if api == "chat":
        return [{"role": "tool", "tool_call_id": turn.call_id, "content": result}]
    if api == "responses":
        return [{"type": "function_call_output", "call_id": turn.call_id, "output": result}]
    return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": turn.call_id, "content": result}]}]


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
