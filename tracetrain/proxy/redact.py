"""Redaction of one call before anything of it is written (docs/architecture.md, "Redaction").

A request's messages are redacted when it arrives: the canonical ones are what the token chain hashes,
so a later request repeating them finds its parent by the same redacted hash the store holds. When the
call is recorded, its stored messages and replies get placeholders, and every token that spells a found
value becomes a filler id, masked, so the sequences keep their length and everything else its ids.
The values found live in this call's memory only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from tracetrain.proxy.chain import ChainNode
from tracetrain.proxy.render import ChatRenderer, canonical_message, history_hashes
from tracetrain.redaction.redactor import Found, Redactor


@dataclass
class RequestRedaction:
    messages: list[dict[str, Any]]
    """The canonical messages as stored (placeholders under `redact`): what the chain hashes."""
    sent: list[dict[str, Any]]
    """The request's messages as sent, as stored."""
    counts: list[Counter[str]]
    """What each sent message held, by type."""
    values: set[str]


@dataclass
class KeptCall:
    """What the store gets of a call's choices."""

    replies: list[dict[str, Any]]
    prompt_ids: list[int]
    completions: list[list[int]]
    redactions: list[dict[str, Any] | None]
    counts: dict[str, int] | None
    """This request's findings in what it stores, for the session's counts."""


class Redactors:
    """The redactor of each caller: its key's own mode (config `api_keys`), else the gateway's."""

    def __init__(self, default: Redactor, by_owner: dict[str, Redactor] | None = None) -> None:
        self.default = default
        self._by_owner = by_owner or {}

    def of(self, owner: str | None) -> Redactor:
        """The redactor for the key with fingerprint `owner` (None: a gateway without keys)."""
        return self._by_owner.get(owner, self.default) if owner is not None else self.default


def redact_request(redactor: Redactor, messages: list[dict[str, Any]],
                   sent: list[dict[str, Any]]) -> RequestRedaction | None:
    """Find what the request holds; None when redaction is off."""
    if not redactor.active:
        return None
    found = Found()
    canonical = [redactor.document(m, found) for m in messages]
    stored, counts = [], []
    for message in sent:
        own = Found()
        stored.append(redactor.document(message, own))
        counts.append(own.counts)
        found.values |= own.values
    if not redactor.redacts or not found.values:
        canonical, stored = messages, sent  # the same objects: nothing to hash or store differently
    return RequestRedaction(canonical, stored, counts, found.values)


def keep_call(redactor: Redactor, renderer: ChatRenderer, request: RequestRedaction | None, *,
              prompt_delta: list[int], choices: list[tuple[str, list[int]]], replies: list[dict[str, Any]],
              inherited: int) -> KeptCall:
    """The stored form of a request's new prompt ids and each choice's (sampled text, ids) and reply."""
    if request is None:
        return KeptCall(replies, prompt_delta, [ids for _, ids in choices], [None] * len(choices), None)
    asked: Counter[str] = Counter()
    for own in request.counts[inherited:]:
        asked.update(own)
    kept_replies, found_in = [], []
    for (text, _), reply in zip(choices, replies, strict=True):
        found = Found()
        kept_replies.append(redactor.document(reply, found))
        # What the sampled text holds outside the parsed reply (text between tool calls) is masked too.
        redactor.text(text, Found(values=found.values))
        found_in.append(found)
    # A call row counts its request's stored messages and its own reply; the session counts the
    # request's messages once and every reply.
    counts = asked + sum((f.counts for f in found_in), Counter())
    per_call = [dict(asked + f.counts) for f in found_in]
    if not redactor.redacts:
        return KeptCall(replies, prompt_delta, [ids for _, ids in choices],
                        [{"counts": c} if c else None for c in per_call], dict(counts) or None)
    filler = filler_id(renderer)
    prompt_spans = _spans(redactor, renderer, prompt_delta, request.values, None)
    prompt_ids = masked(prompt_delta, prompt_spans, filler)
    completions, redactions = [], []
    for (text, ids), found, call_counts in zip(choices, found_in, per_call, strict=True):
        spans = _spans(redactor, renderer, ids, request.values | found.values, text)
        completions.append(masked(ids, spans, filler))
        redactions.append({"counts": call_counts, "prompt": prompt_spans, "completion": spans}
                          if call_counts or prompt_spans or spans else None)
    return KeptCall(kept_replies, prompt_ids, completions, redactions, dict(counts) or None)


def extends_exactly(parent: ChainNode, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> bool:
    """Whether the token chain of `parent`, found by the redacted hash of `messages`, is exactly what they
    say: never when the chain was read from the store with masked tokens (the values are gone), and in
    memory only when the original messages hash the same (the same placeholders can hide other values)."""
    if parent.redacted:
        return False
    return parent.real_state is None or parent.real_state == history_hashes(tools, messages[:parent.message_count])[-1]


def chat_states(redactor: Redactor, request: RequestRedaction | None, tools: list[dict[str, Any]] | None,
                messages: list[dict[str, Any]], reply: dict[str, Any]) -> tuple[str, str | None]:
    """A chat call's state hash as stored (of the redacted messages and reply, what a later request
    hashes to find it), and the hash of the originals when it differs (kept in memory only)."""
    real = history_hashes(tools, [*messages, canonical_message(reply)])[-1]
    if request is None or not redactor.redacts:
        return real, None
    kept_reply = redactor.document(canonical_message(reply), Found())
    if request.messages is messages and kept_reply == canonical_message(reply):
        return real, None
    return history_hashes(tools, [*request.messages, kept_reply])[-1], real


def _spans(redactor: Redactor, renderer: ChatRenderer, ids: list[int], values: set[str],
           text: str | None) -> list[list[int]]:
    """Token ranges of `ids` spelling one of `values`; decoding only when a value may be there."""
    if not ids or not values or (text is not None and not any(v in text for v in values)):
        return []
    return [list(span) for span in redactor.token_spans(token_pieces(renderer, ids), values, scan=False)]


def masked(ids: list[int], spans: list[list[int]], filler: int) -> list[int]:
    if not spans:
        return ids
    out = list(ids)
    for start, end in spans:
        out[start:end] = [filler] * (end - start)
    return out


def filler_id(renderer: ChatRenderer) -> int:
    """The id a masked token is stored as: the tokenizer's unknown token, else padding, else end of text."""
    tokenizer = renderer.tokenizer
    for name in ("unk_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def token_pieces(renderer: ChatRenderer, ids: list[int]) -> list[str]:
    """The text each token adds, so that the pieces join to the decoded sequence. A character split over
    several tokens is given to the last of them (the others add ""). Tokenizers whose tokens decode
    differently alone (a SentencePiece word's leading space) fall back to decoding growing windows."""
    decode = renderer.tokenizer.decode
    pieces = renderer.token_texts(ids)
    out: list[str] = []
    start = 0  # the first token of a character not complete yet
    for i, piece in enumerate(pieces):
        if start == i and "\ufffd" not in piece:
            out.append(piece)
            start = i + 1
            continue
        group = decode(ids[start:i + 1])
        if not group.endswith("\ufffd") or i + 1 - start >= 4:
            out += [""] * (i - start) + [group]
            start = i + 1
    if start < len(ids):
        out += [""] * (len(ids) - start - 1) + [decode(ids[start:])]
    if "".join(out) == decode(ids):
        return out
    out = []
    for i in range(len(ids)):
        low = max(0, i - 6)
        before, now = decode(ids[low:i]), decode(ids[low:i + 1])
        out.append(now[len(before):] if now.startswith(before) else now[len(before.rstrip("\ufffd")):])
    return out
