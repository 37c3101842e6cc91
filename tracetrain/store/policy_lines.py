"""The registry of named policies (`policy_lines`): create, read and list them, and filter sessions by one.

The `default` line is in every store (migration 0012). Lines declared in the config file are added when a
gateway starts (`ensure`), those created over the API with `create`; a name, once taken, keeps its line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from tracetrain.store.models import DEFAULT_POLICY, PolicyLine


def get(db: Session, *, name: str) -> PolicyLine | None:
    return db.get(PolicyLine, name)


def names(db: Session) -> list[str]:
    return list(db.exec(select(PolicyLine.name).order_by(col(PolicyLine.name))).all())


def listed(db: Session, *, name: str | None = None) -> Sequence[PolicyLine]:
    """Every line by name, or only `name`'s (empty when there is none)."""
    query = select(PolicyLine).order_by(col(PolicyLine.created_at), col(PolicyLine.name))
    if name is not None:
        query = query.where(PolicyLine.name == name)
    return db.exec(query).all()


def retention_days(db: Session) -> dict[str, int | None]:
    """Each line whose settings give a `retention_days` of its own: days, or None for forever."""
    return {line.name: line.settings["retention_days"] for line in listed(db) if "retention_days" in line.settings}


def create(db: Session, *, name: str, training: str, settings: dict[str, Any],
           source: str = "api") -> PolicyLine | None:
    """Add a line and commit; None when the name is taken (the existing line is left as it was)."""
    line = PolicyLine(name=name, training=training, settings=settings, source=source)
    db.add(line)
    try:
        db.commit()
    except IntegrityError:
        db.rollback()
        return None
    db.refresh(line)
    return line


def ensure(db: Session, *, declared: Iterable[tuple[str, str, dict[str, Any]]]) -> None:
    """Add the config's lines (name, training, settings) that the store lacks, and the default line, in one
    commit; a line already stored keeps its row (the config file's settings apply through the config)."""
    wanted = [(DEFAULT_POLICY, "lora", {}), *declared]
    for _ in range(2):  # once more if another gateway process added some of them meanwhile
        have = set(names(db))
        for name, training, settings in wanted:
            if name not in have:
                db.add(PolicyLine(name=name, training=training, settings=settings,
                                  source="builtin" if name == DEFAULT_POLICY else "config"))
                have.add(name)
        try:
            db.commit()
            return
        except IntegrityError:
            db.rollback()
