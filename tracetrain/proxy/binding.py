"""Which session and group a request belongs to: the most explicit source wins.

URL path (/s/{session}/g/{group}/v1/…) > X-Session-Id / X-Group-Id headers > the body's `metadata`
(`session_id`, `group_id`) > its `user` (Anthropic: `metadata.user_id`). An unbound call becomes a
one-call session named after its completion id. Without an explicit group, the group is a hash of the
session's first prompt, so repeats of the same task meet in one group for GRPO-style baselines.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tracetrain.proxy.errors import APIError

MAX_ID_LEN = 256


@dataclass
class Binding:
    session_id: str | None
    group_id: str | None


def _check(value: str | None, what: str) -> str | None:
    if value is not None and (not value or len(value) > MAX_ID_LEN or not value.isprintable()):
        raise APIError(400, f"Invalid {what}: 1 to {MAX_ID_LEN} printable characters.", code=f"invalid_{what}")
    return value


def bind(request: Request, *, metadata: dict[str, Any] | None = None, user: str | None = None) -> Binding:
    """`metadata` and `user` are the request body's (OpenAI `metadata`/`user`; Anthropic `metadata`
    with its `user_id`)."""
    params = request.path_params
    metadata = metadata or {}
    session = params.get("session") or request.headers.get("x-session-id") or metadata.get("session_id") or user
    group = params.get("group") or request.headers.get("x-group-id") or metadata.get("group_id")
    return Binding(_check(session, "session_id"), _check(group, "group_id"))


def prompt_group(messages: list[dict[str, Any]]) -> str:
    """Group key of a session without one: the history up to and including the first user turn."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    blob = json.dumps(messages[: first_user + 1], sort_keys=True, ensure_ascii=False)
    return "p-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
