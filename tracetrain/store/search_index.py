"""SQLite's index for the session list's text search, filled in batches (migrations 0005 and 0007).

The gateway's writer indexes the calls past `call_search_state.indexed_rowid` every so often, a few
hundred to a transaction, instead of each call in its own write (see migration 0007 for the costs); a
search scans the calls past the mark (store/console.py), so that its answers do not wait for this.
Several gateway processes on one file may all run it: each batch reads and moves the mark inside the
writer's IMMEDIATE transaction, so no call is indexed twice.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlmodel import Session

BATCH = 256
"""Calls per indexing transaction: every call indexed in it makes the gateway's commit that waits behind
it later, so a batch is bounded (bench/search_index_cost.py, in git history at af20f58)."""

_HAS_STATE = text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'call_search_state'")
_MARK = text("SELECT indexed_rowid FROM call_search_state")
_UPTO = text("SELECT max(rowid) FROM (SELECT rowid FROM calls WHERE rowid > :mark ORDER BY rowid LIMIT :n)")
_LAST_ROW = text("SELECT coalesce(max(id), 0) FROM call_search_rows")
_ROWS = text("INSERT OR IGNORE INTO call_search_rows (call_id, session_id) SELECT id, session_id FROM calls "
             "WHERE rowid > :mark AND rowid <= :upto ORDER BY rowid")
_TEXT = text("INSERT INTO call_search (rowid, messages, reply) SELECT r.id, lower(c.messages), "
             "lower(c.response_message) FROM call_search_rows r JOIN calls c ON c.id = r.call_id WHERE r.id > :last")
_MOVE = text("UPDATE call_search_state SET indexed_rowid = :upto")


def batched(db: Session) -> bool:
    """Whether this store's search index is filled in batches (SQLite with FTS5, at migration 0007)."""
    return db.get_bind().dialect.name == "sqlite" and db.connection().execute(_HAS_STATE).first() is not None


def index_new_calls(db: Session, *, limit: int = BATCH) -> int:
    """Index up to `limit` calls past the mark and move it; how many were indexed (a writer op)."""
    conn = db.connection()
    mark = conn.execute(_MARK).scalar_one()
    upto = conn.execute(_UPTO, {"mark": mark, "n": limit}).scalar()
    if upto is None:
        return 0
    last = conn.execute(_LAST_ROW).scalar_one()
    added = conn.execute(_ROWS, {"mark": mark, "upto": upto}).rowcount
    conn.execute(_TEXT, {"last": last})
    conn.execute(_MOVE, {"upto": upto})
    return int(added)
