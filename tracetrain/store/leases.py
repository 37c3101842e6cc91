"""Trainer claims on finished sessions: a lease so that several trainers never train the same row.

A claim is one conditional UPDATE (atomic on SQLite and PostgreSQL alike): it takes sessions that
have a final reward, are not consumed, and whose lease is free or expired. A crashed trainer's lease
simply runs out and the sessions go to the next claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import and_, or_, update
from sqlmodel import Session, col, func, select

from tracetrain.store.models import AgentSession, Policy, utcnow


def claim_sessions(db: Session, *, trainer_id: str, limit: int, lease_s: float) -> list[str]:
    now = utcnow()
    candidates = (
        select(AgentSession.id)
        .where(AgentSession.status == "final", col(AgentSession.trained_version).is_(None),
               or_(col(AgentSession.lease_until).is_(None), col(AgentSession.lease_until) < now))
        .order_by(col(AgentSession.updated_at))
        .limit(limit)
    )
    ids = list(db.exec(candidates).all())
    if not ids:
        return []
    until = now + timedelta(seconds=lease_s)
    db.execute(
        update(AgentSession)
        .where(and_(col(AgentSession.id).in_(ids),
                    or_(col(AgentSession.lease_until).is_(None), col(AgentSession.lease_until) < now)))
        .values(lease_owner=trainer_id, lease_until=until)
    )
    db.commit()
    # Another trainer may have won some of them between the select and the update.
    mine = select(AgentSession.id).where(col(AgentSession.id).in_(ids), col(AgentSession.lease_owner) == trainer_id,
                                         col(AgentSession.lease_until) == until)
    return list(db.exec(mine).all())


def release_sessions(db: Session, *, trainer_id: str, session_ids: Sequence[str]) -> None:
    db.execute(update(AgentSession)
               .where(col(AgentSession.id).in_(session_ids), col(AgentSession.lease_owner) == trainer_id)
               .values(lease_owner=None, lease_until=None))
    db.commit()


def consume_sessions(db: Session, *, trainer_id: str, session_ids: Sequence[str], version: int,
                     skip_reason: str | None = None) -> None:
    """Mark sessions as used by the step that produced `version` (or skipped, with the reason)."""
    if not session_ids:
        return
    db.execute(update(AgentSession)
               .where(col(AgentSession.id).in_(session_ids), col(AgentSession.lease_owner) == trainer_id)
               .values(trained_version=version, skip_reason=skip_reason, lease_owner=None, lease_until=None))
    db.commit()


def latest_policy(db: Session) -> Policy | None:
    return db.exec(select(Policy).order_by(col(Policy.version).desc()).limit(1)).first()


def ready_count(db: Session) -> int:
    query = select(func.count()).select_from(AgentSession).where(
        AgentSession.status == "final", col(AgentSession.trained_version).is_(None))
    return int(db.exec(query).one())
