"""Database engines: SQLite in WAL mode by default, PostgreSQL by URL."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, create_engine, select

from tracetrain.store.models import Policy


def make_engine(url: str, *, sqlite_synchronous: str = "FULL") -> Engine:
    """Create the engine and the tables. `sqlite_synchronous=FULL` makes each commit survive a
    power cut, not just a killed process; group commit keeps its cost to one fsync per batch."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={sqlite_synchronous}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
    else:
        engine = create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)
    SQLModel.metadata.create_all(engine)
    with Session(engine) as db:
        if db.exec(select(Policy).where(Policy.version == 0)).first() is None:
            db.add(Policy(version=0))
            db.commit()
    return engine


def sessions(engine: Engine) -> Iterator[Session]:
    with Session(engine) as db:
        yield db
