"""An index for the session list's text search (`GET /v1/sessions?q=`), which matches a case-insensitive
substring of any call's stored request messages or reply (their JSON text). Without it every search
reads the messages of every call.

SQLite: `call_search`, a contentless FTS5 table with the trigram tokenizer over the lower-cased JSON
text of each call's messages and reply (SQLite's `lower()`, as the search's `LIKE` compares: a match in
the index is exactly a match of the scan), and `call_search_rows`, which maps its rows to calls and
sessions. Triggers on `calls` keep both in the writing transaction, for every writer (the gateway, the
ORM, plain SQL). Contentless: the text is not stored a second time. A later migration that rebuilds
`calls` with `batch_alter_table` drops its triggers and must create them again. A SQLite without FTS5
or the trigram tokenizer (before 3.34) gets no index: the search then scans, as before.

PostgreSQL: trigram GIN indexes (`pg_trgm`) on the two columns' text, which `ILIKE '%…%'` uses as it
is. Where the extension cannot be created (not installed, or the role may not), no index: the search
scans, as before.

Existing calls are indexed here.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op
from sqlalchemy.exc import DBAPIError

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

log = logging.getLogger(__name__)

_FTS_DELETE = ("INSERT INTO call_search (call_search, rowid, messages, reply) "
               "SELECT 'delete', r.id, lower(old.messages), lower(old.response_message) "
               "FROM call_search_rows r WHERE r.call_id = old.id;")

SQLITE_UP = [
    # `id` is the FTS row's rowid; `call_id` finds it again when a call is deleted or changed.
    "CREATE TABLE call_search_rows (id INTEGER PRIMARY KEY, call_id VARCHAR(128) NOT NULL UNIQUE, "
    "session_id VARCHAR(256) NOT NULL)",
    # case_sensitive 1 over lower()-ed text: the tokenizer's own folding would also fold non-ASCII
    # letters, which the scan's lower() does not. columnsize=0: no ranking, no per-row sizes to keep.
    "CREATE VIRTUAL TABLE call_search USING fts5(messages, reply, content='', columnsize=0, "
    "tokenize='trigram case_sensitive 1')",
    "CREATE TRIGGER call_search_insert AFTER INSERT ON calls BEGIN "
    "INSERT INTO call_search_rows (call_id, session_id) VALUES (new.id, new.session_id); "
    "INSERT INTO call_search (rowid, messages, reply) "
    "VALUES (last_insert_rowid(), lower(new.messages), lower(new.response_message)); END",
    # A contentless table forgets a row only when told the values it indexed.
    f"CREATE TRIGGER call_search_delete AFTER DELETE ON calls BEGIN {_FTS_DELETE} "
    "DELETE FROM call_search_rows WHERE call_id = old.id; END",
    "CREATE TRIGGER call_search_update AFTER UPDATE OF id, session_id, messages, response_message ON calls BEGIN "
    f"{_FTS_DELETE} "
    "UPDATE call_search_rows SET call_id = new.id, session_id = new.session_id WHERE call_id = old.id; "
    "INSERT INTO call_search (rowid, messages, reply) SELECT r.id, lower(new.messages), lower(new.response_message) "
    "FROM call_search_rows r WHERE r.call_id = new.id; END",
    "INSERT INTO call_search_rows (call_id, session_id) SELECT id, session_id FROM calls ORDER BY rowid",
    "INSERT INTO call_search (rowid, messages, reply) SELECT r.id, lower(c.messages), lower(c.response_message) "
    "FROM call_search_rows r JOIN calls c ON c.id = r.call_id",
    # One segment instead of the backfill's many: fewer doclists to read per search.
    "INSERT INTO call_search (call_search) VALUES ('optimize')",
]
SQLITE_DOWN = ["DROP TRIGGER IF EXISTS call_search_update", "DROP TRIGGER IF EXISTS call_search_delete",
               "DROP TRIGGER IF EXISTS call_search_insert", "DROP TABLE IF EXISTS call_search",
               "DROP TABLE IF EXISTS call_search_rows"]
PG_INDEXES = {"ix_calls_messages_trgm": "messages", "ix_calls_response_message_trgm": "response_message"}


def _sqlite_has_trigram_fts(bind: sa.Connection) -> bool:
    version = tuple(int(part) for part in str(bind.exec_driver_sql("SELECT sqlite_version()").scalar()).split("."))
    fts5 = bind.exec_driver_sql("SELECT sqlite_compileoption_used('ENABLE_FTS5')").scalar()
    return bool(fts5) and version >= (3, 34)


def _pg_trgm(bind: sa.Connection) -> bool:
    """Whether pg_trgm is (or could now be) installed in this database."""
    if bind.exec_driver_sql("SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'").first() is not None:
        return True
    if bind.exec_driver_sql("SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm'").first() is None:
        return False
    try:
        with bind.begin_nested():  # a refused CREATE EXTENSION must not abort the migration's transaction
            bind.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    except DBAPIError as exc:
        log.warning("pg_trgm could not be created (%s); the session list's text search will scan", exc.orig)
        return False
    return True


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        if not _sqlite_has_trigram_fts(bind):
            log.warning("this SQLite has no FTS5 trigram tokenizer; the session list's text search will scan")
            return
        for statement in SQLITE_UP:
            op.execute(statement)
    elif bind.dialect.name == "postgresql" and _pg_trgm(bind):
        for name, column in PG_INDEXES.items():
            # The expression is the one the search's ILIKE compares: `column::text`.
            op.execute(f"CREATE INDEX IF NOT EXISTS {name} ON calls USING gin (({column}::text) gin_trgm_ops)")
        # Statistics of the indexed expressions now, not at autovacuum's next analyze: without them the planner
        # takes a common word for a rare one and collects every match through the index, where a page of
        # the newest sessions needed only a short scan.
        op.execute("ANALYZE calls")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for statement in SQLITE_DOWN:
            op.execute(statement)
    elif bind.dialect.name == "postgresql":
        for name in PG_INDEXES:
            op.execute(f"DROP INDEX IF EXISTS {name}")
