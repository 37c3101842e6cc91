"""A client's retry of a recorded call: found by its request, and replaced rather than duplicated.

An SDK retries a call whose response it never got. When the first try was recorded (its response was
lost on the way back, or a stream dropped after the record), the retry would otherwise be a second
call on the same parent: a branch, or a new segment for a session's first call. The serving core
instead replaces the recorded call with the retry's: the client only ever saw the retry's reply, and
the trajectory must be what the agent continued from (docs/architecture.md, "Retries").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, update
from sqlmodel import Session, col, select

from tracetrain.store import queries
from tracetrain.store.messages import full_messages
from tracetrain.store.models import CHAINED_LINKS, AgentSession, Call, Reward


def retried_calls(db: Session, *, session_id: str, messages: list[dict[str, Any]]) -> Sequence[Call]:
    """The choices of the session's latest request whose messages (as stored) are `messages` and which
    no call extends yet; empty when there is none. A call something already extends was delivered."""
    calls = queries.session_calls(db, session_id=session_id)
    by_id = {c.id: c for c in calls}
    chained = {c.parent_id for c in calls if c.link in CHAINED_LINKS}
    for call in sorted(calls, key=lambda c: (c.seq, c.created_at), reverse=True):
        if full_messages(call, by_id) != messages:
            continue
        choices = [c for c in calls if c.completion_id == call.completion_id]
        if any(c.id in chained for c in choices):
            return []
        return sorted(choices, key=lambda c: c.choice_index)
    return []


def drop_retried(db: Session, *, session_id: str, completion_id: str, new_completion_id: str) -> bool:
    """Remove the calls of the request `completion_id` that a retry replaces (a writer op, just before
    the retry's calls are recorded): the session's counts lose them, and rewards posted for one of its
    choices move to the retry's choice of the same index. False (nothing changed) when the calls are
    gone or something extends them by now: the retry is then recorded as a call of its own."""
    old = [c for c in queries.calls_by_completion(db, completion_id=completion_id) if c.session_id == session_id]
    if not old or db.exec(select(Call.id).where(col(Call.session_id) == session_id,
                                                col(Call.parent_id).in_([c.id for c in old]),
                                                col(Call.link).in_(CHAINED_LINKS))).first() is not None:
        return False
    tokens = old[0].prompt_tokens - old[0].prefix_len + sum(c.completion_tokens for c in old)
    session = db.get(AgentSession, session_id)
    if session is not None:
        counts = dict(session.redactions or {})
        for kind, n in _request_counts(old).items():
            counts[kind] = max(counts.get(kind, 0) - n, 0)
        session.calls = max(session.calls - len(old), 0)
        session.tokens = max(session.tokens - tokens, 0)
        session.redactions = {k: n for k, n in counts.items() if n} or None
        db.add(session)
    for call in old:
        db.execute(update(Reward).where(col(Reward.session_id) == session_id, col(Reward.call_id) == call.id)
                   .values(call_id=f"{new_completion_id}-{call.choice_index}"))
    db.execute(delete(Call).where(col(Call.id).in_([c.id for c in old])))
    db.flush()
    return True


def _request_counts(calls: Sequence[Call]) -> dict[str, int]:
    """What a request added to its session's redaction counts: each call row counts the request's messages
    and its own reply, the session counted the messages once. Exact for one choice; for several, what
    every choice holds is taken for the messages' part."""
    per_call = [((c.redactions or {}).get("counts") or {}) for c in calls]
    kinds = {kind for counts in per_call for kind in counts}
    total: dict[str, int] = {}
    for kind in kinds:
        found = [counts.get(kind, 0) for counts in per_call]
        total[kind] = sum(found) - (len(found) - 1) * min(found)
    return total
