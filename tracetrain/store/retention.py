"""Retention and erasure: clear the content of sessions and keep their figures.

A purge removes what a session said: every call's messages, reply, request parameters (tools, schemas),
prompt and sampled token ids and logprobs (the ids spell the text), and its chain hash. It keeps what the
figures need: the session row (status, counts, reward, versions, timestamps, redaction counts), its
rewards, and each call's row with its link, version, token counts, finish reason and latency. The session
is marked (`purged`: `retention` or `deleted`, `purged_at`) and is never claimed for training or exported
again (store/leases.py, store/export.py).

`purge_expired` clears sessions whose last activity is older than their retention, `erase_session` one
session at an admin's request (`DELETE /v1/sessions/{id}`). Both are writer ops: one batch of at most
`BATCH` sessions per transaction, so a purge of a large store never holds the write lock for long while
the gateway serves.

Cleared values must leave the files too, not only the rows:
- SQLite: the purge's statements run with `PRAGMA secure_delete`, so the bytes of the old values are
  overwritten, not left in free space; the search index (migration 0005, a contentless FTS5 table) drops a
  cleared call's trigrams through its update trigger, and `compact_search_index` merges its segments so
  that the deleted entries are gone from them too; `checkpoint` copies the WAL into the file and truncates
  it, so old page images do not stay in the WAL.
- PostgreSQL: the trigram indexes follow the columns; the old row versions stay in the table's pages until
  VACUUM reclaims them (autovacuum, or `VACUUM calls` after an erasure; docs/operations.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, or_, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from tracetrain.store import audit, policy_lines
from tracetrain.store.models import PURGED_STATE, AgentSession, Call, utcnow
from tracetrain.store.writer import WriteOp

log = logging.getLogger(__name__)

BATCH = 200
"""Sessions cleared per transaction: each adds its calls' updates to the writer's transaction, so a batch is
bounded and the gateway's own commits wait behind one batch at most."""

CLEARED_CALL: dict[str, Any] = {
    "messages": [], "messages_inherited": 0, "response_message": {"role": "assistant", "content": None},
    "request_params": {}, "prompt_ids": b"", "completion_ids": b"", "completion_logprobs": b"",
    "state_hash": PURGED_STATE,
}
"""What a purged call keeps of its content: nothing (the columns are not nullable)."""


@dataclass(frozen=True)
class Retention:
    """How long sessions keep their content, the most specific rule first: `by_owner` for the sessions of
    one key (by fingerprint), else `by_policy` for those of one named policy, else `days` (None: forever).
    A None value in either mapping keeps those sessions forever."""

    days: int | None = None
    by_owner: Mapping[str, int | None] = field(default_factory=dict)
    by_policy: Mapping[str, int | None] = field(default_factory=dict)

    def expired(self, now: datetime) -> ColumnElement[bool] | None:
        """Sessions whose last activity is older than their retention; None when nothing ever expires."""
        updated = col(AgentSession.updated_at)
        terms = [and_(col(AgentSession.owner) == owner, updated < now - timedelta(days=days))
                 for owner, days in self.by_owner.items() if days is not None]
        no_key_rule: ColumnElement[bool] = col(AgentSession.owner).is_(None)
        if self.by_owner:
            no_key_rule = or_(no_key_rule, col(AgentSession.owner).not_in(list(self.by_owner)))
        terms += [and_(no_key_rule, col(AgentSession.policy) == policy, updated < now - timedelta(days=days))
                  for policy, days in self.by_policy.items() if days is not None]
        if self.days is not None:
            rest = and_(no_key_rule, col(AgentSession.policy).not_in(list(self.by_policy))) if self.by_policy \
                else no_key_rule
            terms.append(and_(rest, updated < now - timedelta(days=self.days)))
        return or_(*terms) if terms else None

    def with_policies(self, db: Session) -> Retention:
        """These rules with each named policy's own `retention_days` as the store holds it now, so that a
        policy created over the API counts from the next purge on."""
        return replace(self, by_policy=policy_lines.retention_days(db))

    def describe(self) -> dict[str, Any]:
        return {"retention_days": self.days, "keys_with_own_retention": len(self.by_owner),
                "policies_with_own_retention": len(self.by_policy)}


def _not_cleared_since() -> ColumnElement[bool]:
    """Never purged, or a call was recorded after its last purge (an agent went on using the session id)."""
    return or_(col(AgentSession.purged_at).is_(None), col(AgentSession.updated_at) > col(AgentSession.purged_at))


def _lease_free(now: datetime) -> ColumnElement[bool]:
    """No trainer is reading it for a step: a purge waits for the lease to end."""
    return or_(col(AgentSession.lease_until).is_(None), col(AgentSession.lease_until) < now)


@contextmanager
def _secure_delete(db: Session) -> Iterator[None]:
    """SQLite overwrites the bytes of what these statements delete or replace (it leaves them in free space
    otherwise); a no-op on PostgreSQL."""
    sqlite = db.get_bind().dialect.name == "sqlite"
    if sqlite:
        db.connection().exec_driver_sql("PRAGMA secure_delete = ON")
    try:
        yield
    finally:
        if sqlite:
            db.connection().exec_driver_sql("PRAGMA secure_delete = OFF")


def _clear_calls(db: Session, *, session_ids: Sequence[str]) -> int:
    """Clear the content of every call of these sessions; returns how many calls."""
    with _secure_delete(db):
        done = db.execute(update(Call).where(col(Call.session_id).in_(session_ids)).values(**CLEARED_CALL)
                          .execution_options(synchronize_session=False))
    return int(done.rowcount)  # type: ignore[attr-defined]


def anything_expires(db: Session, *, retention: Retention) -> bool:
    """Whether any rule, the policies' as stored now included, ever clears a session's content."""
    return retention.with_policies(db).expired(utcnow()) is not None


def purge_expired(db: Session, *, retention: Retention, actor: str | None, now: datetime | None = None,
                  limit: int = BATCH) -> int:
    """Clear up to `limit` sessions whose content is past `retention` (oldest activity first), mark them
    `retention` (a session already `deleted` stays so) and record one audit entry; returns how many were
    cleared (fewer than `limit`: nothing else has expired). A writer op."""
    now = now or utcnow()
    retention = retention.with_policies(db)
    expired = retention.expired(now)
    if expired is None:
        return 0
    candidates = db.exec(select(AgentSession.id).where(expired, _not_cleared_since(), _lease_free(now))
                         .order_by(col(AgentSession.updated_at)).limit(limit)).all()
    if not candidates:
        return 0
    # The conditions again in the update: a trainer may have claimed one since the select (PostgreSQL).
    marked = db.execute(update(AgentSession).where(col(AgentSession.id).in_(candidates), _lease_free(now),
                                                   _not_cleared_since())
                        .values(purged=_keep_deleted(), purged_at=now).returning(col(AgentSession.id))
                        .execution_options(synchronize_session=False))
    session_ids = [row[0] for row in marked]
    if not session_ids:
        return 0
    calls = _clear_calls(db, session_ids=session_ids)
    audit.record(db, action="purge", actor=actor, sessions=len(session_ids),
                 detail={**retention.describe(), "calls": calls})
    return len(session_ids)


def _keep_deleted() -> ColumnElement[str]:
    """A purge marks `retention`, but a session an admin deleted stays `deleted`."""
    return case((col(AgentSession.purged) == "deleted", "deleted"), else_="retention")


@dataclass(frozen=True)
class Erasure:
    """What `erase_session` did: the session after it, how many calls it cleared, and whether the session was
    already deleted before (a repeated request: cleared again, not recorded again)."""

    session: AgentSession
    calls: int
    already: bool


def erase_session(db: Session, *, session_id: str, actor: str | None, reason: str = "") -> Erasure | None:
    """Clear one session's content now (an erasure request), whatever its age or lease, mark it `deleted` and
    record who asked and why; None if it does not exist. A second request clears what was recorded since
    (if anything) and records nothing."""
    session = db.get(AgentSession, session_id, with_for_update=True)
    if session is None:
        return None
    already = session.purged == "deleted"
    now = utcnow()
    session.purged, session.purged_at = "deleted", now
    # A trainer holding it loses it: its step must not read the content of a deleted session.
    session.lease_owner, session.lease_until = None, None
    db.add(session)
    db.flush()
    calls = _clear_calls(db, session_ids=[session_id])
    if not already:
        audit.record(db, action="delete", actor=actor, session_id=session_id, sessions=1,
                     detail={"reason": reason, "calls": calls})
    return Erasure(session=session, calls=calls, already=already)


_HAS_INDEX = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'call_search'"


def compact_search_index(db: Session, *, pages: int = 64) -> bool:
    """One step of merging SQLite's search index into one segment, which drops the entries of cleared calls
    for good; whether it did any work (call it until it did none). False at once on other stores."""
    if db.get_bind().dialect.name != "sqlite":
        return False
    conn = db.connection()
    if conn.exec_driver_sql(_HAS_INDEX).first() is None:
        return False
    before = conn.exec_driver_sql("SELECT total_changes()").scalar_one()
    with _secure_delete(db):
        # A negative page count merges every segment, level by level, as 'optimize' would, a step at a time.
        conn.execute(text("INSERT INTO call_search (call_search, rank) VALUES ('merge', :pages)"), {"pages": -pages})
    after = conn.exec_driver_sql("SELECT total_changes()").scalar_one()
    return bool(after - before > 1)


CHECKPOINT_TRIES = 50
CHECKPOINT_PAUSE_S = 0.1


def checkpoint(db: Engine) -> bool:
    """Copy SQLite's WAL into the database file and truncate it, so the old page images of cleared values
    leave the WAL; a no-op on PostgreSQL. Returns whether the WAL was emptied. A reader still on an old
    snapshot (a console query, the search indexer) makes the checkpoint busy; those are short, so it tries
    again for a few seconds before it gives up with a warning (SQLite's own checkpoints overwrite the WAL
    later)."""
    if db.dialect.name != "sqlite":
        return True
    for _ in range(CHECKPOINT_TRIES):
        with db.connect() as conn:
            row = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").first()
        if row is None or not row[0]:  # (busy, WAL frames, frames checkpointed)
            return True
        time.sleep(CHECKPOINT_PAUSE_S)
    log.warning("the WAL could not be emptied after a purge: a reader held an old snapshot throughout")
    return False


COMPACT_STEPS = 256
"""Most merge steps of the search index after one purge: under steady traffic new segments keep coming, and
the next purge goes on where this one stopped."""


async def purge(submit: Callable[[WriteOp], Awaitable[Any]], db: Engine, *, retention: Retention,
                actor: str | None) -> int:
    """Clear every session past `retention`, one batch per writer transaction (`submit`: the store writer's),
    then compact SQLite's search index and checkpoint its WAL; returns how many sessions were cleared."""
    total = 0
    while True:
        cleared: int = await submit(lambda s: purge_expired(s, retention=retention, actor=actor))
        total += cleared
        if cleared < BATCH:
            break
    if total:
        await scrub(submit, db)
    return total


async def scrub(submit: Callable[[WriteOp], Awaitable[Any]], db: Engine) -> None:
    """After content was cleared: merge SQLite's search index, a step per transaction, and checkpoint."""
    for _ in range(COMPACT_STEPS):
        if not await submit(lambda s: compact_search_index(s)):
            break
    await asyncio.to_thread(checkpoint, db)
