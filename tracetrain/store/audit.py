"""The audit log: who exported, corrected, marked not for training, purged or deleted what, and when.

Exports, purges and deletions are rows of `audit_log`, written in the same transaction as what they record
(an export's row before its first line). Corrections and `no_train` are not written twice: `session_actions`
keeps each of them already, with its note and its old and new values, in the transaction that made it
(store/corrections.py), so `entries` reads both tables as one list, newest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import literal, union_all
from sqlmodel import Session, col, func, select

from tracetrain.store.models import AuditEntry, SessionAction


def record(db: Session, *, action: str, actor: str | None, sessions: int, session_id: str | None = None,
           detail: dict[str, Any] | None = None) -> AuditEntry:
    """Add one entry in the caller's transaction."""
    entry = AuditEntry(action=action, actor=actor, session_id=session_id, sessions=sessions, detail=detail or {})
    db.add(entry)
    db.flush()
    return entry


@dataclass(frozen=True)
class Entry:
    """One line of the audit log, from either table."""

    id: str
    """`log-<n>` for an `audit_log` row, `action-<n>` for a correction (`GET /v1/sessions/{id}/actions`)."""
    created_at: datetime
    action: str
    actor: str | None
    session_id: str | None
    sessions: int
    detail: dict[str, Any]


def _correction_action(action: str) -> str:
    return "no_train" if action == "no_train" else "correction"


def entries(db: Session, *, action: str | None = None, session_id: str | None = None, limit: int = 100,
            offset: int = 0) -> tuple[list[Entry], int]:
    """A page of entries, newest first, and how many match in all. `action` is one of `AUDIT_ACTIONS`."""
    logged: Any = select(literal("log").label("source"), col(AuditEntry.id).label("id"),
                         col(AuditEntry.created_at).label("created_at"))
    if action is not None:
        logged = logged.where(col(AuditEntry.action) == action)
    if session_id is not None:
        logged = logged.where(col(AuditEntry.session_id) == session_id)
    corrected: Any = select(literal("action").label("source"), col(SessionAction.id).label("id"),
                            col(SessionAction.created_at).label("created_at"))
    if action == "no_train":
        corrected = corrected.where(col(SessionAction.action) == "no_train")
    elif action == "correction":
        corrected = corrected.where(col(SessionAction.action) != "no_train")
    if session_id is not None:
        corrected = corrected.where(col(SessionAction.session_id) == session_id)
    parts: list[Any] = []
    if action not in ("correction", "no_train"):
        parts.append(logged)
    if action in (None, "correction", "no_train"):
        parts.append(corrected)
    compound: Any = union_all(*parts) if len(parts) > 1 else parts[0]
    both = compound.subquery()
    total = int(db.exec(select(func.count()).select_from(both)).one())
    keys = db.exec(select(both.c.source, both.c.id).order_by(both.c.created_at.desc(), both.c.source.desc(),
                                                              both.c.id.desc()).limit(limit).offset(offset)).all()
    logs = {e.id: e for e in db.exec(select(AuditEntry).where(
        col(AuditEntry.id).in_([i for s, i in keys if s == "log"]))).all()}
    actions = {a.id: a for a in db.exec(select(SessionAction).where(
        col(SessionAction.id).in_([i for s, i in keys if s == "action"]))).all()}
    found = []
    for source, key in keys:
        if source == "log":
            e = logs[key]
            found.append(Entry(f"log-{key}", e.created_at, e.action, e.actor, e.session_id, e.sessions, e.detail))
        else:
            a = actions[key]
            found.append(Entry(f"action-{key}", a.created_at, _correction_action(a.action), a.actor, a.session_id, 1,
                               {"correction": a.action, "note": a.note, "old_value": a.old_value,
                                "new_value": a.new_value}))
    return found, total
