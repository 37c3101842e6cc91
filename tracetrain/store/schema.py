"""Schema revisions of the store, kept with Alembic (`tracetrain/store/migrations/`).

A new, empty store is created at the newest revision. A store at an older revision, or one made by
tracetrain 0.1 (its tables, no `alembic_version`), is never changed behind the user's back: opening
it raises `StoreOutOfDate`, which says to run `tracetrain db upgrade` (after a backup). That command
stamps a 0.1 store with the baseline revision, whose tables it has, and applies the later ones.

Several processes may open one new store at once (`serve --workers N`, gateways and a trainer started
together). One at a time checks and creates its schema, under a lock: a PostgreSQL advisory lock, or for
SQLite an exclusive `flock` on a file beside the database (`<file>-schema.lock`). Without it, one process
saw another's tables before their revision was written (SQLite commits each CREATE TABLE on its own) and
refused the store as tracetrain 0.1's, or failed creating a table that had just appeared.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from importlib.resources import files

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

BASELINE = "0001"
"""The revision whose tables tracetrain 0.1 created without Alembic."""
TABLES = {"sessions", "calls", "rewards", "policies"}
ADVISORY_LOCK = 0x7472_6163_6574_7261  # "tracetra": the PostgreSQL advisory lock key of schema changes


class StoreOutOfDate(RuntimeError):
    """The store's schema is older than this tracetrain's; `tracetrain db upgrade` migrates it."""


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(files("tracetrain.store") / "migrations"))
    config.attributes["connection"] = connection
    return config


@cache
def head() -> str:
    """The newest revision this tracetrain knows."""
    return str(ScriptDirectory.from_config(_config()).get_current_head())


def revision(db: Engine) -> tuple[str | None, bool]:
    """(the store's revision, whether it has tracetrain's tables)."""
    with db.connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
        tables = set(inspect(connection).get_table_names())
    return current, bool(tables & TABLES)


@contextmanager
def schema_lock(db: Engine) -> Iterator[None]:
    """One process at a time checks or changes the store's schema (see the module's docstring)."""
    if db.dialect.name == "postgresql":
        with db.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": ADVISORY_LOCK})
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_LOCK})
                connection.commit()
    elif db.dialect.name == "sqlite" and db.url.database not in (None, "", ":memory:"):
        with open(f"{db.url.database}-schema.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    else:
        yield


def ensure_current(db: Engine) -> None:
    """Create an empty store at the newest revision; refuse an older one with what to run."""
    current, _ = revision(db)
    if current == head():
        return
    with schema_lock(db):
        current, has_tables = revision(db)  # another process may have created it while this one waited
        if current == head():
            return
        if current is None and not has_tables:
            _upgrade(db)
            return
    found = current or "tracetrain 0.1 (no revision)"
    raise StoreOutOfDate(
        f"The store at {db.url.render_as_string(hide_password=True)} has schema {found}; this tracetrain "
        f"needs {head()}. Back it up, then run: tracetrain db upgrade --db-url '<the same URL>'")


def upgrade(db: Engine) -> tuple[str | None, str]:
    """Migrate the store to the newest revision; returns (revision before, revision after)."""
    with schema_lock(db):
        return _upgrade(db)


def _upgrade(db: Engine) -> tuple[str | None, str]:
    before, has_tables = revision(db)
    with db.begin() as connection:
        config = _config(connection)
        if before is None and has_tables:
            missing = TABLES - set(inspect(connection).get_table_names())
            if missing:
                raise StoreOutOfDate(f"This store lacks tables {sorted(missing)}: it was not made by tracetrain.")
            command.stamp(config, BASELINE)
        command.upgrade(config, "head")
    return before, head()
