"""The token chain of a session: which earlier call a request extends, and its exact prompt ids.

A request extends call P when its messages begin with P's request messages followed by P's reply
(compared by hash of their canonical form). Its prompt is then P's prompt + P's sampled ids + the
template's glue after the reply + the rendered new messages, so the model sees exactly what it
produced. Otherwise the call starts a new segment and the reason is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracetrain.proxy.render import ChatRenderer


@dataclass
class ChainNode:
    """What a later request needs to extend a call: its full token chain and whether it has a child."""

    call_id: str
    full_ids: list[int]
    message_count: int
    """Messages of the request plus the reply: the length of history this node stands for."""
    has_child: bool = False
    request_messages: list[dict[str, Any]] | None = None
    """The call's request messages as stored, when known: a call extending it stores only what it added."""
    redacted: bool = False
    """Read from the store with tokens masked by redaction: not the ids the engine saw."""
    real_state: str | None = None
    """The hash of the call's original messages and reply where redaction changed them (memory only)."""


@dataclass
class PromptPlan:
    prompt_ids: list[int]
    prefix_len: int
    parent_id: str | None
    link: str


def plan_prompt(
    renderer: ChatRenderer,
    *,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    parent: ChainNode | None,
    session_has_calls: bool,
) -> PromptPlan:
    """Build the engine prompt for canonical `messages`, extending `parent` when the template allows.

    Only the new part is tokenized: the history's tokens are the parent's, token for token, and the
    tail starts at a special token (ChatML's <|im_start|>), so tokenizing it alone cannot merge across
    the boundary. That also keeps the work per call independent of the conversation's length.
    """
    full = renderer.render_text(messages, tools, generation=True)
    if parent is None:
        return PromptPlan(renderer.encode(full), 0, None, "prefix_changed" if session_has_calls else "start")

    history = renderer.render_text(messages[: parent.message_count], tools, generation=False)
    if not full.startswith(history):
        # The template renders history differently once more messages follow: no exact chain.
        return PromptPlan(renderer.encode(full), 0, parent.call_id, "template_mismatch")
    ended = bool(parent.full_ids) and parent.full_ids[-1] == renderer.turn_end_id
    added = renderer.encode(renderer.glue(history, reply_ended=ended) + full[len(history):])
    link = "branch" if parent.has_child else "extend"
    return PromptPlan(parent.full_ids + added, len(parent.full_ids), parent.call_id, link)
