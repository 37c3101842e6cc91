"""Request and response models of the console's JSON API: who the caller is, the overview, the session
list, an admin's corrections to a session (exclude, include, reward override and clearing it) and their
audit trail, capture quality, and each call's conversation items (what it added, what it replied)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tracetrain.proxy.protocol import RequestModel
from tracetrain.store.console import added_messages
from tracetrain.store.models import AgentSessionPublic, Call, SessionActionPublic

MAX_NOTE = 4000


class NoteRequest(RequestModel):
    """Optional body of exclude and include: why."""

    model_config = ConfigDict(extra="forbid")
    note: str = Field(default="", max_length=MAX_NOTE)


class RewardOverrideRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    reward: Annotated[float, Field(strict=True, allow_inf_nan=False)]
    """The reward the trainer uses for this session from now on, in place of the posted ones."""
    note: str = Field(max_length=MAX_NOTE)


class CorrectionResponse(BaseModel):
    """The session's state after an admin's action, and the action as stored."""

    session_id: str
    excluded: bool
    reward: float | None
    """The reward the trainer uses: the override if set, else the sum of the posted rewards."""
    reward_override: float | None
    trained_version: int | None
    """Set when a trainer already learned from the session (before this action): a correction changes
    only what is trained from now on."""
    action: SessionActionPublic


class EraseRequest(RequestModel):
    """Optional body of `DELETE /v1/sessions/{id}`: why (an erasure request's reference), kept in the audit log."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="", max_length=MAX_NOTE)


class ErasureResponse(BaseModel):
    """A session after its content was deleted."""

    object: Literal["session.deleted"] = "session.deleted"
    session_id: str
    purged: str
    """`deleted`."""
    purged_at: datetime
    calls_cleared: int
    """Calls whose content this request cleared (again, on a repeated request: a session still used after its
    deletion has new calls)."""
    already_deleted: bool
    """True when an earlier request had deleted it: the answer is the same, and no new audit entry is made."""


class AuditEntryPublic(BaseModel):
    """One line of the audit log."""

    id: str
    """`log-<n>` for exports, purges and deletions; `action-<n>` for a correction or `no_train` (the same as
    in `GET /v1/sessions/{id}/actions`)."""
    created_at: datetime
    action: Literal["export", "correction", "no_train", "purge", "delete"]
    actor: str | None
    """Fingerprint of the key that acted (None: a gateway without keys); `retention` for the gateway's
    scheduled purge, `cli` for a command."""
    session_id: str | None
    """The session it concerned; None when it concerned many."""
    sessions: int
    """How many sessions it concerned."""
    detail: dict[str, Any]
    """Export: `format`; purge: `retention_days`, `calls`; delete: `reason`, `calls`; correction: its kind
    (`correction`), `note`, `old_value`, `new_value`."""


class AuditList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AuditEntryPublic]
    total: int
    """Entries matching the filters, on every page."""
    has_more: bool
    limit: int
    offset: int


class ActionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionActionPublic]


class SessionSummary(AgentSessionPublic):
    """A row of the session list."""

    policy_version_min: int | None = None
    """Oldest policy version among the session's calls (None: no calls)."""
    policy_version_max: int | None = None


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionSummary]
    total: int
    """Sessions matching the filters, on every page."""
    has_more: bool
    limit: int
    offset: int


class CaptureRow(BaseModel):
    model: str | None
    owner: str | None
    """Fingerprint of the API key (None: a gateway without keys)."""
    calls: int
    chained: int
    """Calls that extended their session's token chain (or branched off it), token for token."""
    chained_share: float | None
    """`chained` over the calls that had an earlier call to extend (not a session's first)."""
    segment_starts: dict[str, int]
    """Calls that began a new token segment, by reason (`start`, `prefix_changed`, ...)."""
    set_aside: dict[str, int]
    """Finished sessions the trainer did not consume, by reason (`stale`, `zero_variance`, `no_samples`,
    `excluded`)."""


class CaptureStats(BaseModel):
    object: Literal["capture_stats"] = "capture_stats"
    total: CaptureRow
    """Every model and key together."""
    data: list[CaptureRow]
    """Per model and API key owner."""


class WhoAmI(BaseModel):
    """Who the caller is, as the gateway sees its key: what the console shows depends on it."""

    owner: str | None
    """Fingerprint of the caller's key (None: a gateway without keys)."""
    admin: bool
    keys_required: bool
    """False on a gateway without keys (loopback only): every caller is an anonymous admin."""
    policy: str | None = None
    """The named policy the caller's key is bound to (`gateway.api_keys[].policy`): it sees only that policy's
    sessions. None: a key bound to none."""


class TrafficCounters(BaseModel):
    """Counters since this gateway process started (its Prometheus metrics): a client takes the rate
    between two readings and their `time`."""

    requests: int
    """Generation requests answered, every status."""
    failed_requests: int
    """Those answered with an error status."""
    prompt_tokens: int
    completion_tokens: int
    sessions_created: int
    rewards: int
    """Reward events stored."""


class TrainerState(BaseModel):
    state: Literal["held", "stepping", "waiting"]
    """`held`: new generations are held (a `sync`-mode training step or a weight reload);
    `stepping`: a trainer has claimed sessions for a step it is gathering or training; `waiting`: no
    claim runs, `ready` sessions wait for a trainer."""
    ready: int
    """Finished sessions no trainer has claimed yet."""
    leased: int
    """Sessions claimed for a step in progress."""
    holders: list[str]
    """Who holds new generations now (`train`, `publish`, `remote:<trainer>`)."""
    last_step_at: datetime | None
    """When the newest trained version was recorded (None: none yet)."""


class LastPublish(BaseModel):
    version: int
    published_at: datetime | None
    """None when it failed (see `error`)."""
    seconds: float | None
    """How long handing the checkpoint to the engine took."""
    error: str | None


class Overview(BaseModel):
    object: Literal["overview"] = "overview"
    time: float
    """The gateway's clock (Unix seconds) when the counters were read."""
    counters: TrafficCounters
    store_queue_depth: int
    """Writes waiting for the group-commit writer."""
    policy: str | None = None
    """The named policy the figures below cover (`?policy=`); None: every policy, with the versions the
    default policy's."""
    served_version: int
    """The version of `policy` (None: of the default policy) its new calls get."""
    served_versions: dict[str, int]
    """Each policy's version its calls get now (only `policy`'s when asked)."""
    sessions: dict[str, int]
    """Stored sessions by status (`open`, `final`), of `policy` only when asked."""
    trainer: TrainerState
    last_publish: LastPublish | None
    """The newest trained version's publish, of `policy` or else of the default policy (None: no version
    trained yet)."""


MAX_ITEM_TEXT = 2000
"""Characters of an item's text in the session JSON; the whole text is in the trajectory's tokens."""


class ConversationItem(BaseModel):
    """One thing a call added to the conversation or replied, whatever API it came through: a message, a
    tool call, or a tool's result."""

    type: Literal["message", "tool_call", "tool_result"]
    role: str | None = None
    """A message's role (`system`, `user`, `assistant`, ...)."""
    text: str = ""
    """A message's text, a tool call's arguments (JSON), or a tool result's content."""
    tool_call_id: str | None = None
    """The tool call this is, or answers."""
    name: str | None = None
    """The tool's name (for a result, looked up by `tool_call_id` among the session's calls)."""
    truncated: bool = False
    """`text` was cut at `MAX_ITEM_TEXT` characters."""


def _text(content: Any) -> str:
    """A content value as text: strings as they are, text parts joined, other parts named."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "tool_result":
                parts.append(_text(part.get("content")))
            else:
                parts.append(f"[{part.get('type', 'part') if isinstance(part, dict) else 'part'}]")
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)


def _item(names: dict[str, str], type_: Literal["message", "tool_call", "tool_result"], text: str,
          **fields: Any) -> ConversationItem:
    if type_ == "tool_result" and fields.get("name") is None:
        fields["name"] = names.get(fields.get("tool_call_id") or "")
    return ConversationItem(type=type_, text=text[:MAX_ITEM_TEXT], truncated=len(text) > MAX_ITEM_TEXT, **fields)


def _tool_calls(message: dict[str, Any]) -> list[tuple[str | None, str | None, str]]:
    """(id, name, arguments) of a message's tool calls: OpenAI's `tool_calls` or Anthropic's `tool_use`
    blocks."""
    found = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        found.append((call.get("id"), function.get("name"),
                      arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))
    content = message.get("content")
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_use":
            found.append((block.get("id"), block.get("name"), json.dumps(block.get("input"), ensure_ascii=False)))
    return found


def message_items(message: dict[str, Any], names: dict[str, str]) -> list[ConversationItem]:
    """One stored message as items. Chat and Responses store tool results as `tool` messages, the
    Messages API as `tool_result` blocks of a user message; tool calls come as OpenAI's `tool_calls` or
    Anthropic's `tool_use` blocks."""
    role = message.get("role")
    content = message.get("content")
    if role in ("tool", "function"):
        return [_item(names, "tool_result", _text(content), tool_call_id=message.get("tool_call_id"),
                      name=message.get("name"))]
    items: list[ConversationItem] = []
    if isinstance(content, list):
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        rest = [b for b in content if not (isinstance(b, dict) and b.get("type") in ("tool_result", "tool_use"))]
        items += [_item(names, "tool_result", _text(b.get("content")), tool_call_id=b.get("tool_use_id"))
                  for b in results]
        text = _text(rest) if rest else ""
    else:
        text = _text(content)
    if text or not (items or _tool_calls(message)):
        items.append(_item(names, "message", text, role=role))
    items += [_item(names, "tool_call", arguments, tool_call_id=cid, name=name)
              for cid, name, arguments in _tool_calls(message)]
    return items


def conversation_items(calls: Sequence[Call]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """For each of a session's calls, by id: `added_items`, what its request added after its parent's reply
    (tool results, user turns; a first call's whole request), and `reply_items`, its reply's text and
    tool calls, as JSON."""
    added = added_messages(calls)
    names: dict[str, str] = {}
    for message in [*(c.response_message for c in calls), *(m for ms in added.values() for m in ms)]:
        for cid, name, _ in _tool_calls(message):
            if cid and name:
                names[cid] = name
    return {call.id: {
        "added_items": [i.model_dump(mode="json") for m in added[call.id] for i in message_items(m, names)],
        "reply_items": [i.model_dump(mode="json") for i in message_items(call.response_message, names)],
    } for call in calls}
