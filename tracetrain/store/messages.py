"""A call's request messages, stored once per conversation.

Agents resend the whole history with every request, so storing each request's `messages` as sent
makes a session's storage grow with the square of its length. A call whose request starts with its
parent call's request messages stores only the rest and counts what it left out in
`messages_inherited`; reading rebuilds the whole list by walking up `parent_id`. Messages are compared
as sent (raw JSON), so what is rebuilt is byte for byte what the client sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlmodel import Session

from tracetrain.store.models import Call


def shared_prefix(parent: list[dict[str, Any]], messages: list[dict[str, Any]]) -> int:
    """How many leading messages of `messages` equal the parent's, in order."""
    n = 0
    for ours, theirs in zip(parent, messages, strict=False):
        if ours != theirs:
            break
        n += 1
    return n


def full_messages(call: Call, by_id: Mapping[str, Call]) -> list[dict[str, Any]]:
    """The request messages of `call` as the client sent them, from the session's calls by id."""
    parts = [call.messages]
    take = [call.messages_inherited]
    node = call
    while node.messages_inherited:
        if node.parent_id is None or node.parent_id not in by_id:
            raise LookupError(f"call {node.id} inherits messages from {node.parent_id!r}, which is not stored")
        node = by_id[node.parent_id]
        parts.append(node.messages)
        take.append(node.messages_inherited)
    # parts[-1] is complete; each earlier part keeps the first take[i] messages of the one above it
    messages = list(parts[-1])
    for i in range(len(parts) - 2, -1, -1):
        messages = messages[: take[i]] + list(parts[i])
    return messages


def call_messages(db: Session, *, call: Call) -> list[dict[str, Any]]:
    """`full_messages` for one call, reading its ancestors from the store as needed."""
    by_id: dict[str, Call] = {}
    node = call
    while node.messages_inherited and node.parent_id is not None and node.parent_id not in by_id:
        parent = db.get(Call, node.parent_id)
        if parent is None:
            break
        by_id[parent.id] = parent
        node = parent
    return full_messages(call, by_id)
