"""The store's database connection (`db`, a SQLAlchemy Engine): SQLite in WAL mode by default,
PostgreSQL by URL. `open_db` opens the store, creating or checking its schema; `connect_db` only
connects (for migrating)."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

import orjson
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, create_engine

from tracetrain.store import schema
from tracetrain.store.models import DEFAULT_POLICY, Policy


def open_db(url: str, *, sqlite_synchronous: str = "FULL") -> Engine:
    """Open the store: an empty one gets the tables at the newest schema, an older one raises
    `schema.StoreOutOfDate` saying what to run (see store/schema.py)."""
    db = connect_db(url, sqlite_synchronous=sqlite_synchronous)
    schema.ensure_current(db)
    with Session(db) as s:
        if s.get(Policy, (DEFAULT_POLICY, 0)) is None:
            s.add(Policy(version=0))
            try:
                s.commit()
            except IntegrityError:  # another process opening the new store added it first
                s.rollback()
    return db


def _to_json(value: Any) -> str:
    """JSON columns through orjson (the stdlib encoder was a visible share of the gateway's CPU per
    call); what orjson refuses (integers beyond 64 bits) goes through the stdlib."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value)


def connect_db(url: str, *, sqlite_synchronous: str = "FULL") -> Engine:
    """Connect to the store only, its schema unchecked (for migrating; `open_db` for everything else).
    `sqlite_synchronous=FULL` makes each commit survive a power cut, not just a killed process; group commit
    keeps its cost to one fsync per batch."""
    json_codec: dict[str, Any] = {"json_serializer": _to_json, "json_deserializer": orjson.loads}
    if url.startswith("sqlite"):
        # LIFO: the connection just returned is taken again, so its page cache is the one holding what
        # this process last wrote. The default FIFO pool rotated the gateway's reads and the writer's
        # commits over several connections, and a connection that finds the file changed since its last
        # transaction drops its whole cache: 45 page reads (pread) per call instead of 8 (strace, c=1).
        db = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, pool_use_lifo=True,
                           **json_codec)

        @event.listens_for(db, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cursor = dbapi_conn.cursor()
            _enter_wal(cursor)
            cursor.execute(f"PRAGMA synchronous={sqlite_synchronous}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
        return db
    return create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True, **json_codec)


WAL_SWITCH_WAIT_S = 30.0
"""How long a connection keeps retrying to switch a new store to WAL while another process does the same."""


def _enter_wal(cursor: sqlite3.Cursor) -> None:
    """Put the database in WAL mode. WAL is recorded in the file, so only the first connection ever
    switches it, and that switch needs the file to itself: when several processes open a new store at
    once, SQLite answers the others "database is locked" at once, without waiting on the busy timeout.
    They retry until the switch has happened (then the mode reads back as wal and nothing is left to do)."""
    deadline = time.monotonic() + WAL_SWITCH_WAIT_S
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                return
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
