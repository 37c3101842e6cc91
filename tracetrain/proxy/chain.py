"""The token chain of a session: which earlier call a request extends, and its exact prompt ids.

A request extends call P when its messages begin with P's request messages followed by P's reply
(compared by hash of their canonical form). Its prompt is then P's prompt + P's sampled ids + the
template's glue after the reply + the rendered new messages, so the model sees exactly what it
produced. Otherwise the call starts a new segment and the reason is recorded.
"""

from __future__ import annotations

from collections import OrderedDict
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


@dataclass
class PromptPlan:
    prompt_ids: list[int]
    prefix_len: int
    parent_id: str | None
    link: str


class ChainCache:
    """Recently used chain nodes by (session, state hash); misses fall back to the store."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._nodes: OrderedDict[tuple[str, str], ChainNode] = OrderedDict()

    def get(self, session_id: str, state_hash: str) -> ChainNode | None:
        node = self._nodes.get((session_id, state_hash))
        if node is not None:
            self._nodes.move_to_end((session_id, state_hash))
        return node

    def put(self, session_id: str, state_hash: str, node: ChainNode) -> None:
        self._nodes[(session_id, state_hash)] = node
        self._nodes.move_to_end((session_id, state_hash))
        while len(self._nodes) > self.capacity:
            self._nodes.popitem(last=False)


def plan_prompt(
    renderer: ChatRenderer,
    *,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    parent: ChainNode | None,
    session_has_calls: bool,
) -> PromptPlan:
    """Build the engine prompt for canonical `messages`, extending `parent` when the template allows."""
    full = renderer.render(messages, tools, generation=True)
    if parent is None:
        return PromptPlan(full, 0, None, "prefix_changed" if session_has_calls else "start")

    history = messages[: parent.message_count]
    with_reply = renderer.render(history, tools, generation=False)
    if full[: len(with_reply)] != with_reply:
        # The template renders history differently once more messages follow: no exact chain.
        return PromptPlan(full, 0, parent.call_id, "template_mismatch")
    # Only the template's own tokens after the reply are needed; the reply itself is taken as
    # sampled, which is the point (its re-rendering may tokenize differently).
    glue = renderer.glue(with_reply, parent.full_ids)
    tail = full[len(with_reply) :]
    link = "branch" if parent.has_child else "extend"
    return PromptPlan(parent.full_ids + glue + tail, len(parent.full_ids), parent.call_id, link)
