"""Holds on new generations, shared by every gateway process on the store (see models.GenerationHold)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, select

from tracetrain.store.models import GenerationHold, utcnow


def hold(db: Session, *, holder: str, ttl_s: float) -> None:
    """Hold (again: the time-to-live restarts) until released or `ttl_s` from now."""
    dialect = postgresql if db.get_bind().dialect.name == "postgresql" else sqlite
    expires = utcnow() + timedelta(seconds=ttl_s)
    statement = dialect.insert(GenerationHold).values(holder=holder, expires_at=expires)
    db.execute(statement.on_conflict_do_update(index_elements=["holder"], set_={"expires_at": expires}))


def release(db: Session, *, holder: str) -> None:
    db.execute(delete(GenerationHold).where(col(GenerationHold.holder) == holder))


def active_holders(db: Session) -> Sequence[str]:
    """Holders whose hold has not lapsed."""
    return db.exec(select(GenerationHold.holder).where(col(GenerationHold.expires_at) > utcnow())).all()
