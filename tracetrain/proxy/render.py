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
TOOL_CALL_CLOSE = "</tool_call>"
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_ARGUMENTS_RE = re.compile(r'"arguments"\s*:\s*')
CUT_CALL_PREFIX = "call_cut_"
"""The id of a tool call cut short by the token limit: its arguments are the text generated so far."""
RAW_CALL_PREFIX = "call_raw_"
"""The id of a whole tool call whose arguments are not JSON: they are the text as generated."""
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


def unread_call(call_id: Any) -> bool:
    """Whether a tool call's id marks arguments that are the generated text, not JSON the gateway read."""
    return isinstance(call_id, str) and call_id.startswith((CUT_CALL_PREFIX, RAW_CALL_PREFIX))


def cut_call(call: dict[str, Any]) -> bool:
    """Whether a reply's tool call was cut short by the token limit."""
    return str(call.get("id", "")).startswith(CUT_CALL_PREFIX)


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that reach the model, in one spelling: what hashing and rendering use.
    A call the gateway could not read keeps its id: the chain knows it by that (see `history_hashes`)."""
    role = {"developer": "system", "function": "tool"}.get(message["role"], message["role"])
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    # Only an assistant's tool calls are read, and validated (protocol.ToolCall); a `tool_calls` key on another
    # role is an extra field of any shape, which the model never sees.
    calls = (message.get("tool_calls") or []) if role == "assistant" else []
    if calls:
        out["tool_calls"] = []
        for call in calls:
            function = call.get("function", call)
            canonical = {"name": function.get("name", ""),
                         "arguments": _canonical_arguments(function.get("arguments", "{}"))}
            if unread_call(call.get("id")):
                canonical["id"] = call["id"]
            out["tool_calls"].append(canonical)
    return out


def _hashed(message: dict[str, Any]) -> dict[str, Any]:
    """A canonical message as its hash sees it. A call that was cut short or not JSON counts by its name and
    id alone: clients send such arguments back as given, repaired or dropped (and the Anthropic SDK as the
    object it could read), and each of these must extend the call that produced them."""
    calls = message.get("tool_calls")
    if not calls or not any("id" in call for call in calls):
        return message
    return {**message, "tool_calls": [{"name": c["name"], "id": c["id"]} if "id" in c else c for c in calls]}


def history_hashes(tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[str]:
    """hashes[k] identifies tools + messages[:k]; a call's state hash is that of its request plus reply."""
    digest = hashlib.sha256(json.dumps(tools or [], sort_keys=True).encode()).hexdigest()
    hashes = [digest]
    for message in messages:
        blob = digest + json.dumps(_hashed(message), sort_keys=True, ensure_ascii=False)
        digest = hashlib.sha256(blob.encode()).hexdigest()
        hashes.append(digest)
    return hashes


def parse_reply(text: str, *, tools_enabled: bool, cut: bool = False,
                names: tuple[str, ...] = ()) -> tuple[str, list[dict[str, Any]]]:
    """Split sampled text into content and OpenAI-shaped tool calls; `cut`: the token limit ended the text.

    Each `<tool_call>` block that names a tool is a call, even where its arguments are not JSON (a `call_raw_`
    id) or the limit cut it (a `call_cut_` id, arguments as far as generated, a cut name completed from
    `names` when only one tool starts with it). A whole block that names no tool is not a call when no block
    is one: the text stays content, verbatim. Beside a call it is one too (`_unread_block`): the content ends
    where the calls begin, so the block could stay text only by taking the calls with it.

    Text the limit cut inside the opener itself (`<tool_c`) ends the content before that start of markup
    (and the whitespace before it, as before a call). Only the reply loses it: the sampled tokens are
    recorded, and the chain hashes the reply as returned, so its echo extends the call.
    """
    if not tools_enabled:
        return text, []
    if TOOL_CALL_OPEN not in text:
        opened = partial_end(text, TOOL_CALL_OPEN) if cut else 0
        return (text[:-opened].rstrip() if opened else text), []
    blocks = text.split(TOOL_CALL_OPEN)[1:]
    read: list[tuple[str, bool, dict[str, Any] | None]] = []
    for i, block in enumerate(blocks):
        whole, closed, _ = block.partition(TOOL_CALL_CLOSE)
        # A block that is not closed ends the text: the limit cut it, or the model ended its turn there.
        tail = not closed and i == len(blocks) - 1
        read.append((whole.strip(), tail, _read_call(whole.strip(), cut=cut and tail, names=names, tail=tail)))
    if all(call is None for _, _, call in read):
        return text, []
    calls = [call or _unread_block(block, tail=tail) for block, tail, call in read]
    return text[: text.index(TOOL_CALL_OPEN)].rstrip(), calls


def partial_end(text: str, marker: str) -> int:
    """How many of `text`'s last characters begin `marker` without being all of it (0: none)."""
    return next((k for k in range(len(marker) - 1, 0, -1) if text.endswith(marker[:k])), 0)


def _unread_block(block: str, *, tail: bool) -> dict[str, Any]:
    """A block that names no tool, beside calls: a `call_raw_` call with no name and the block as written for
    arguments (less a closing tag the text ended in), as a call whose arguments are not JSON comes back."""
    closing = partial_end(block, TOOL_CALL_CLOSE) if tail else 0
    arguments = block[:-closing].rstrip() if closing else block
    return {"id": f"{RAW_CALL_PREFIX}{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": "", "arguments": arguments}}


def first_tool_call_only(reply: dict[str, Any]) -> dict[str, Any]:
    """An assistant reply with at most its first tool call (`parallel_tool_calls: false`): what vLLM answers then,
    the model's other calls left out of the reply (not of its sampled tokens)."""
    calls = reply.get("tool_calls")
    return {**reply, "tool_calls": calls[:1]} if calls and len(calls) > 1 else reply


def parse_forced_call(text: str, *, cut: bool = False, names: tuple[str, ...] = ()) -> dict[str, Any]:
    """The call of a forced tool call: the sampled text is the JSON object alone (the grammar ended
    it), so it is parsed whole; a string argument may even contain `</tool_call>`. Cut short by the token
    limit, it is the call as far as generated (see `parse_reply`). Text that names no tool (a stop string of
    the request ended it in the name) is a call all the same, as a block beside calls is (`_unread_block`):
    the request demands a call, and the opener before the text is the gateway's, not the model's."""
    return _read_call(text.strip(), cut=cut, names=names, tail=False) or _unread_block(text.strip(), tail=False)


def _read_call(block: str, *, cut: bool, names: tuple[str, ...], tail: bool) -> dict[str, Any] | None:
    """One call's JSON object as text (`tail`: the text ended in it, maybe in a partial closing tag)."""
    closing = partial_end(block, TOOL_CALL_CLOSE) if tail else 0
    candidates = [block, block[:-closing].rstrip()] if closing else [block]
    for candidate in candidates:
        try:
            payload = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(payload, dict) and isinstance(payload.get("name"), str):
            return _tool_call(payload["name"], payload.get("arguments", {}))
    named = _NAME_RE.search(block)
    if not cut and (named is None or named.group(2) is None):
        return None
    name = _json_string(named.group(1)) if named else ""
    if cut and (named is None or named.group(2) is None):
        matches = [n for n in names if n.startswith(name)]
        name = matches[0] if len(matches) == 1 else name
    found = _ARGUMENTS_RE.search(block, named.end() if named else 0)
    arguments = block[found.end():] if found else ""
    if not cut and arguments.rstrip().endswith("}"):
        arguments = arguments.rstrip()[:-1].rstrip()  # the call object's own closing brace
    prefix = CUT_CALL_PREFIX if cut else RAW_CALL_PREFIX
    return {"id": f"{prefix}{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _json_string(body: str) -> str:
    """A JSON string's characters from its body as written (a cut escape is dropped)."""
    for end in range(len(body), max(len(body) - 6, -1), -1):
        try:
            return str(json.loads(f'"{body[:end]}"'))
        except json.JSONDecodeError:
            continue
    return body


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
        self.vocab_size = len(tokenizer)
        """Token ids below this are the model's (added tokens included). Counted once: transformers counts
        the whole vocabulary on every `len(tokenizer)`, which a text completion's id check paid per call."""
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
