"""SQLite's search index (0005) filled in batches, off the write of each call.

Inserting one call's text into the FTS5 trigram index inside the call's own transaction was a third
to more than half of the gateway writer's CPU per call: FTS5 writes its pending terms out at every commit, so a few
hundred calls to a transaction cost far less per call than one or sixteen
(`bench/results/search_index_cost.md`, in git history at af20f58). So the insert trigger goes;
`call_search_state.indexed_rowid`
marks how far (by the rowid of `calls`) the index goes, the gateway indexes the calls after it in
batches (store/search_index.py), and a search scans the few calls past the mark, so that its answers
stay exact. The delete and update triggers stay: they act on indexed calls only.

SQLite gives the rowid after the largest one to a new row, so a deleted newest call's rowid can come
back; a trigger keeps the mark at or below the largest rowid left, and such a call is indexed again.

PostgreSQL: nothing (its trigram indexes are ordinary indexes).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_LARGEST = "(SELECT coalesce(max(rowid), 0) FROM calls)"
_INSERT_TRIGGER = (  # as 0005 made it
    "CREATE TRIGGER call_search_insert AFTER INSERT ON calls BEGIN "
    "INSERT INTO call_search_rows (call_id, session_id) VALUES (new.id, new.session_id); "
    "INSERT INTO call_search (rowid, messages, reply) "
    "VALUES (last_insert_rowid(), lower(new.messages), lower(new.response_message)); END")


def _has_index(bind: sa.Connection) -> bool:
    return bind.exec_driver_sql(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'call_search'").first() is not None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite" or not _has_index(bind):
        return
    op.execute("DROP TRIGGER IF EXISTS call_search_insert")
    op.execute("CREATE TABLE call_search_state (id INTEGER PRIMARY KEY CHECK (id = 0), "
               "indexed_rowid INTEGER NOT NULL)")
    # 0005's trigger has indexed every call there is.
    op.execute(f"INSERT INTO call_search_state (id, indexed_rowid) VALUES (0, {_LARGEST})")
    op.execute("CREATE TRIGGER call_search_mark AFTER DELETE ON calls BEGIN "
               f"UPDATE call_search_state SET indexed_rowid = {_LARGEST} WHERE indexed_rowid > {_LARGEST}; END")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite" or not _has_index(bind):
        return
    # 0005's trigger indexes each call as it is written: the calls past the mark are indexed first.
    (before,) = bind.exec_driver_sql("SELECT coalesce(max(id), 0) FROM call_search_rows").one()
    op.execute("INSERT OR IGNORE INTO call_search_rows (call_id, session_id) SELECT id, session_id FROM calls "
               "WHERE rowid > (SELECT indexed_rowid FROM call_search_state) ORDER BY rowid")
    op.execute("INSERT INTO call_search (rowid, messages, reply) SELECT r.id, lower(c.messages), "
               "lower(c.response_message) FROM call_search_rows r JOIN calls c ON c.id = r.call_id "
               f"WHERE r.id > {before}")
    op.execute("DROP TRIGGER IF EXISTS call_search_mark")
    op.execute("DROP TABLE IF EXISTS call_search_state")
    op.execute(_INSERT_TRIGGER)
