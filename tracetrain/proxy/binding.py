"""Which session and group a request belongs to: the most explicit source wins.

The named policy a call belongs to is bound elsewhere: by its key or a `/p/{policy}` path prefix (proxy/auth.py),
and by its `model` (proxy/serving.py).

URL path (/s/{session}/g/{group}/v1/…) > X-Session-Id / X-Group-Id headers > the body's `metadata`
(`session_id`, `group_id`) > its `user` (Anthropic: `metadata.user_id`). An unbound call becomes a
one-call session named after its completion id. Without an explicit group, the group is a hash of the
session's first prompt, so repeats of the same task meet in one group for GRPO-style baselines.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Request
from pydantic import Field

from tracetrain.proxy.errors import APIError
from tracetrain.proxy.policy_lines import check_policy_name

MAX_ID_LEN = 256
ID_CHARACTERS = "[^\\x00-\\x1f\\x7f-\\x9f\\u200b-\\u200f\\u2028-\\u202e\\u2060-\\u2069\\ufeff]"
"""What a session or group id may hold: anything but control characters (C0, DEL, C1), zero-width and direction
marks, line and paragraph separators, bidirectional embeddings, overrides and isolates, and the byte order mark:
characters that would hide or disguise an id wherever it is shown. One regex for the OpenAPI document (JSON Schema)
and for the check here, so the two cannot disagree."""
ID_PATTERN = f"^{ID_CHARACTERS}*$"
_ID_RE = re.compile(ID_PATTERN)
ID_RULE = ("no control characters, zero-width or direction marks, line or paragraph separators, bidirectional "
           "controls or byte order mark")
ID_DESCRIPTION = f"Up to {MAX_ID_LEN} characters: {ID_RULE}"

BindingId = Annotated[str, Field(max_length=MAX_ID_LEN, pattern=ID_PATTERN, description=(
    f"{ID_DESCRIPTION}. Binds the call to a session or group (docs/api.md); empty binds nothing."))]
"""A body field that may name the session or group (`user`, `metadata.session_id`, ...): the same rule as the path."""


@dataclass
class Binding:
    session_id: str | None
    group_id: str | None
    retry: bool = False
    """The client says it is retrying this request (`x-stainless-retry-count` above 0, sent by the OpenAI
    and Anthropic SDKs): it replaces a recorded call with the same messages (store/retries.py)."""
    train: bool = True
    """False (`X-Train: no`): the session is never trained on or exported for training."""


RETRY_HEADER = "x-stainless-retry-count"


def _retry(value: str | None) -> bool:
    return value is not None and value.strip().isdigit() and int(value) > 0


_TRAIN = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}


def _train(value: str | None) -> bool:
    if value is None:
        return True
    if value.strip().lower() not in _TRAIN:
        raise APIError(400, "Invalid X-Train header: 'yes' or 'no'.", code="invalid_x_train")
    return _TRAIN[value.strip().lower()]


def _check(value: str | None, what: str) -> str | None:
    if value is not None and (not value or len(value) > MAX_ID_LEN or not _ID_RE.fullmatch(value)):
        raise APIError(400, f"Invalid {what}: 1 to {MAX_ID_LEN} characters, {ID_RULE}.", code=f"invalid_{what}")
    return value


_HEADER_SAFE = "".join(c for c in string.printable if c not in "%\t\n\r\x0b\x0c")


def header_value(session_id: str) -> str:
    """A session id as the `X-Session-Id` response header carries it: percent-encoded (UTF-8) beyond
    printable ASCII, and `%` itself, so that `urllib.parse.unquote` gives the id back. A header holds
    Latin-1 at most, and any other id (a `user` in Chinese) made the whole answer a 500."""
    return quote(session_id, safe=_HEADER_SAFE)


def bind(request: Request, *, metadata: dict[str, Any] | None = None, user: str | None = None) -> Binding:
    """`metadata` and `user` are the request body's (OpenAI `metadata`/`user`; Anthropic `metadata`
    with its `user_id`)."""
    params = request.path_params
    metadata = metadata or {}
    # An empty value binds nothing: the next source is asked.
    session = (params.get("session") or request.headers.get("x-session-id") or metadata.get("session_id") or user
               or None)
    group = params.get("group") or request.headers.get("x-group-id") or metadata.get("group_id") or None
    return Binding(_check(session, "session_id"), _check(group, "group_id"), _retry(request.headers.get(RETRY_HEADER)),
                   _train(request.headers.get("x-train")))


async def check_path_ids(request: Request) -> None:
    """Every route under `/s/{session}` (and `/g/{group}`, `/p/{policy}`) holds its path's ids to the rule the
    document states, whether or not it binds anything with them (the model list, a stored response)."""
    params = request.path_params
    if "policy" in params:
        check_policy_name(params["policy"])
    _check(params.get("session"), "session_id")
    _check(params.get("group"), "group_id")


def prompt_group(messages: list[dict[str, Any]]) -> str:
    """Group key of a session without one: the history up to and including the first user turn."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    blob = json.dumps(messages[: first_user + 1], sort_keys=True, ensure_ascii=False)
    return "p-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
