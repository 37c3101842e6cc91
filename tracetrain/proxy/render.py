"""Chat templates and tool calls, rendered by the gateway itself.

The gateway turns messages into token ids (so the engine sees exactly what is recorded) and turns
sampled text back into an assistant message with Hermes-style `<tool_call>{json}</tool_call>` blocks.
Models whose own template cannot render tools (SmolLM2's) get the bundled ChatML-with-tools template,
keeping the model's default system prompt.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from importlib.resources import files
from typing import Any

from tracetrain.proxy.segments import make_segment_encoder

BUNDLED_TEMPLATE = (files("tracetrain.proxy") / "templates" / "chatml_tools.jinja").read_text(encoding="utf-8")
"""Read as package data (importlib.resources), so it is found in an installed wheel, not only in a checkout;
pyproject.toml's [tool.setuptools.package-data] is what puts it into the wheel."""
TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_DEFAULT_SYSTEM_RE = re.compile(r"<\|im_start\|>system(?:\\n|\n)(.+?)<\|im_end\|>", re.DOTALL)


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type", "text") == "text")


def _canonical_arguments(arguments: Any) -> str:
    if not isinstance(arguments, str):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that reach the model, in one spelling: what hashing and rendering use."""
    role = {"developer": "system", "function": "tool"}.get(message["role"], message["role"])
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "name": call.get("function", call).get("name", ""),
                "arguments": _canonical_arguments(call.get("function", call).get("arguments", "{}")),
            }
            for call in calls
        ]
    return out


def history_hashes(tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[str]:
    """hashes[k] identifies tools + messages[:k]; a call's state hash is that of its request plus reply."""
    digest = hashlib.sha256(json.dumps(tools or [], sort_keys=True).encode()).hexdigest()
    hashes = [digest]
    for message in messages:
        blob = digest + json.dumps(message, sort_keys=True, ensure_ascii=False)
        digest = hashlib.sha256(blob.encode()).hexdigest()
        hashes.append(digest)
    return hashes


def parse_reply(text: str, *, tools_enabled: bool) -> tuple[str, list[dict[str, Any]]]:
    """Split sampled text into content and OpenAI-shaped tool calls. Unparseable blocks stay text."""
    if not tools_enabled or TOOL_CALL_OPEN not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    for block in _TOOL_CALL_RE.findall(text):
        try:
            payload = json.loads(block)
            name = payload["name"]
            arguments = payload.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
        calls.append(_tool_call(name, arguments))
    if not calls:
        return text, []
    return text[: text.index(TOOL_CALL_OPEN)].rstrip(), calls


def first_tool_call_only(reply: dict[str, Any]) -> dict[str, Any]:
    """An assistant reply with at most its first tool call (`parallel_tool_calls: false`): what vLLM answers then,
    the model's other calls left out of the reply (not of its sampled tokens)."""
    calls = reply.get("tool_calls")
    return {**reply, "tool_calls": calls[:1]} if calls and len(calls) > 1 else reply


def parse_forced_call(text: str) -> list[dict[str, Any]]:
    """The call of a forced tool call: the sampled text is the JSON object alone (the grammar ended
    it), so it is parsed whole; a string argument may even contain `</tool_call>`. [] if cut short."""
    try:
        payload = json.loads(text)
        return [_tool_call(payload["name"], payload.get("arguments", {}))]
    except (json.JSONDecodeError, KeyError, TypeError):
        return []


def _tool_call(name: Any, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": str(name), "arguments": _canonical_arguments(arguments)},
    }


class ChatRenderer:
    def __init__(self, tokenizer: Any, *, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None) or ""
        self.default_system: str | None = None
        if template is not None:
            self.template = template
        elif "tools" in own:
            self.template = own
        else:
            self.template = BUNDLED_TEMPLATE
            found = _DEFAULT_SYSTEM_RE.search(own)
            self.default_system = found.group(1).replace("\\n", "\n") if found else None
        # The Rust tokenizer itself when there is one: transformers' `encode` goes through `encode_batch`,
        # whose thread pool showed up in the gateway's profile under load; same ids.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        vocab = tokenizer.get_vocab()
        self.turn_end_id: int | None = vocab.get("<|im_end|>", tokenizer.eos_token_id)
        self.turn_end_text: str | None = (
            None if self.turn_end_id is None else tokenizer.convert_ids_to_tokens(self.turn_end_id))
        self._segments = None if self._backend is None else make_segment_encoder(self._backend, self._samples())

    def render_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool
    ) -> str:
        """The template's text for canonical `messages`; `generation` appends the assistant turn opener."""
        if self.default_system and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.default_system}, *messages]
        # `strict` steers the API's schema checking, not the model: it is not rendered (OpenAI's own
        # rendering leaves it out too), so agents that send it see the same prompt as those that do not.
        functions = [{k: v for k, v in tool.get("function", tool).items() if k != "strict"}
                     for tool in tools] if tools else None
        return str(self.tokenizer.apply_chat_template(
            messages, tools=functions, chat_template=self.template, tokenize=False,
            add_generation_prompt=generation,
        ))

    def _samples(self) -> list[str]:
        """Prompts on which encoding by pieces must give the ids of encoding whole (proxy/segments.py)."""
        call = {"name": "lookup", "arguments": '{"q": "naïve  café"}'}
        conversation: list[dict[str, Any]] = [{"role": "system", "content": " Be brief.\n\n Really."},
                        {"role": "user", "content": "  Hello\tthere 日本語 🙂 it's 12345"},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "{\"a\": [1, 2]}\n"}, {"role": "user", "content": "x"}]
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        return [self.render_text(conversation, tools, generation=True), self.render_text(conversation[1:2], None,
                generation=False), " leading space", "trailing \n\n", "a<tool_call>b</tool_call> c"]

    def encode(self, text: str) -> list[int]:
        if self._segments is not None:
            return self._segments.encode(text)
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool
    ) -> list[int]:
        return self.encode(self.render_text(messages, tools, generation=generation))

    def glue(self, history_text: str, *, reply_ended: bool) -> str:
        """Text the template puts after the last assistant reply of `history_text` (ChatML: the newline
        after <|im_end|>). If the model stopped without the turn-end token (length limit, stop string),
        the turn end itself is added, as the template would have rendered it."""
        end = self.turn_end_text
        if end is None or end not in history_text:
            return ""
        last = history_text.rindex(end)
        return history_text[last + len(end):] if reply_ended else history_text[last:]

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (a character split across tokens shows as U+FFFD in each part)."""
        return [str(text) for text in self.tokenizer.batch_decode([[t] for t in token_ids])]
