"""Small keyword-only queries over the store; each takes an open session."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, bindparam, case, insert, literal_column, update
from sqlalchemy import select as core_select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlmodel import Session, col, func, select

from tracetrain.store.models import (
    CHAINED_LINKS,
    DEFAULT_POLICY,
    PURGED_STATE,
    AgentSession,
    Call,
    Policy,
    Reward,
    utcnow,
)
from tracetrain.store.prepared import Prepared
from tracetrain.store.promotion import ROLLED_BACK


def get_session(db: Session, *, session_id: str) -> AgentSession | None:
    return db.get(AgentSession, session_id)


# The serving core's per-call statements, compiled once per dialect and run on the driver's cursor
# (store/prepared.py): built per call with their values inlined they cost a cache-key walk and often
# a compile, and even cached, Core's execution machinery cost more than the SQL (profiled).
_SESSIONS: Table = AgentSession.__table__  # type: ignore[attr-defined]
_CALLS: Table = Call.__table__  # type: ignore[attr-defined]
SESSION_COLUMNS = tuple(_SESSIONS.columns.keys())
CALL_COLUMNS = tuple(_CALLS.columns.keys())
"""What a row handed to `record_calls` carries: every column of `calls` but `seq` and `link`, which
the write decides (and `redactions`, None when left out)."""
_INSERT_SESSION = {name: Prepared(dialect.insert(_SESSIONS).on_conflict_do_nothing(), SESSION_COLUMNS)
                   for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))}
_TOUCH_SESSION = Prepared(update(_SESSIONS).where(_SESSIONS.c.id == bindparam("sid")).values(
    updated_at=bindparam("now"), calls=_SESSIONS.c.calls + bindparam("n"), tokens=_SESSIONS.c.tokens + bindparam("t")))
_NEXT_SEQ = Prepared(core_select(func.max(_CALLS.c.seq)).where(_CALLS.c.session_id == bindparam("sid")))
# The links inlined as SQL literals: an IN over bound values expands per execution.
_CHAINED_CHILD = Prepared(core_select(_CALLS.c.id).where(
    _CALLS.c.session_id == bindparam("sid"), _CALLS.c.parent_id == bindparam("parent"),
    _CALLS.c.link.in_([literal_column(f"'{link}'") for link in CHAINED_LINKS])).limit(1))
_INSERT_CALLS = Prepared(insert(_CALLS), CALL_COLUMNS)
_POLICIES: Table = Policy.__table__  # type: ignore[attr-defined]
# FOR SHARE on PostgreSQL (SQLite renders nothing: the writer's IMMEDIATE transaction holds the file's lock).
_PROMOTION_LOCKED = Prepared(core_select(_POLICIES.c.promotion).where(
    _POLICIES.c.line == bindparam("line"), _POLICIES.c.version == bindparam("v")).with_for_update(read=True))
_SESSION_OWNER = Prepared(core_select(_SESSIONS.c.owner, _SESSIONS.c.group_id, _SESSIONS.c.policy_version,
                                       _SESSIONS.c.policy).where(_SESSIONS.c.id == bindparam("sid")))


def session_row(*, id: str, group_id: str, owner: str | None, policy_version: int | None, model: str | None,
                calls: int, tokens: int, policy: str = DEFAULT_POLICY) -> dict[str, Any]:
    """A new `sessions` row as the serving core inserts it: every column, the rest at their defaults
    (a plain dict: building an `AgentSession` model showed up in the gateway's profile of new sessions)."""
    now = utcnow()
    return {**_SESSION_DEFAULTS, "id": id, "group_id": group_id, "owner": owner, "created_at": now,
            "updated_at": now, "model": model, "calls": calls, "tokens": tokens, "policy_version": policy_version,
            "policy": policy}


_SESSION_DEFAULTS = {"status": "open", "reward": None, "reward_override": None, "excluded": False, "lease_owner": None,
                     "lease_until": None, "trained_version": None, "skip_reason": None, "redactions": None,
                     "purged": None, "purged_at": None}
if set(SESSION_COLUMNS) - _SESSION_DEFAULTS.keys() != {"id", "group_id", "owner", "created_at", "updated_at",
                                                       "model", "calls", "tokens", "policy_version", "policy"}:
    raise RuntimeError("the sessions table changed: give its new column a default in _SESSION_DEFAULTS")


def add_session_if_absent(db: Session, *, row: dict[str, Any]) -> bool:
    """Insert a `session_row` unless its id exists (two first calls of one session may race): one
    INSERT … ON CONFLICT DO NOTHING. True when this insert created it."""
    conn = db.connection()
    statement = _INSERT_SESSION["postgresql" if conn.dialect.name == "postgresql" else "sqlite"]
    return bool(statement.execute(conn, row).rowcount == 1)


def session_owner_group(conn: Connection, *, session_id: str) -> tuple[str | None, str, int | None, str] | None:
    """(owner, group, version it started on, policy) of a stored session, or None: the gateway's check on
    every call of a session it has not cached."""
    row = _SESSION_OWNER.execute(conn, {"sid": session_id}).fetchone()
    return None if row is None else (row[0], row[1], row[2], row[3])


def session_calls(db: Session, *, session_id: str) -> Sequence[Call]:
    query = select(Call).where(Call.session_id == session_id).order_by(col(Call.seq), col(Call.choice_index))
    return db.exec(query).all()


def session_rewards(db: Session, *, session_id: str) -> Sequence[Reward]:
    query = select(Reward).where(Reward.session_id == session_id).order_by(col(Reward.id))
    return db.exec(query).all()


def calls_by_completion(db: Session, *, completion_id: str) -> Sequence[Call]:
    return db.exec(select(Call).where(Call.completion_id == completion_id)).all()


def call_by_state(db: Session, *, session_id: str, state_hash: str) -> Call | None:
    query = select(Call).where(Call.session_id == session_id, Call.state_hash == state_hash)
    return db.exec(query.order_by(col(Call.seq).desc())).first()


def has_chained_child(db: Session, *, call_id: str, session_id: str) -> bool:
    """Whether a call already has a child that continues its chain (by session: that column is indexed)."""
    query = select(Call.id).where(Call.session_id == session_id, Call.parent_id == call_id,
                                  col(Call.link).in_(["extend", "branch"]))
    return db.exec(query.limit(1)).first() is not None


def reward_by_key(db: Session, *, session_id: str, idempotency_key: str) -> Reward | None:
    query = select(Reward).where(Reward.session_id == session_id, Reward.idempotency_key == idempotency_key)
    return db.exec(query).first()


def all_session_ids(db: Session, *, policy: str | None = None) -> Sequence[str]:
    """Every session id, oldest first; only one named policy's with `policy`."""
    query = select(AgentSession.id).order_by(col(AgentSession.created_at))
    if policy is not None:
        query = query.where(AgentSession.policy == policy)
    return db.exec(query).all()


def latest_call_id(db: Session, *, session_id: str) -> str | None:
    """The session's latest call that something may extend (a purged call has no tokens left to extend)."""
    query = select(Call.id).where(Call.session_id == session_id, Call.state_hash != PURGED_STATE).order_by(
        col(Call.seq).desc())
    return db.exec(query.limit(1)).first()


def latest_published(db: Session, *, line: str = DEFAULT_POLICY) -> Policy | None:
    """The newest version of `line` a trainer published (to any gateway on this store)."""
    query = select(Policy).where(Policy.line == line, col(Policy.published_at).is_not(None)).order_by(
        col(Policy.version).desc())
    return db.exec(query.limit(1)).first()


def latest_published_by_line(db: Session) -> dict[str, Policy]:
    """Each line's newest published version (lines with none published are left out)."""
    published = col(Policy.published_at).is_not(None)
    newest = select(Policy.line, func.max(Policy.version).label("version")).where(published).group_by(
        col(Policy.line)).subquery()
    query = select(Policy).join(newest, (col(Policy.line) == newest.c.line) & (col(Policy.version) == newest.c.version))
    return {row.line: row for row in db.exec(query).all()}


def list_policies(db: Session, *, line: str | None = None) -> Sequence[Policy]:
    """Every line's versions (by line, then version), or only `line`'s."""
    query = select(Policy).order_by(col(Policy.line), col(Policy.version))
    if line is not None:
        query = query.where(Policy.line == line)
    return db.exec(query).all()


def record_calls(db: Session, *, session_id: str, new_session: dict[str, Any] | None,
                 rows: list[dict[str, Any]], check_rollback: bool = False,
                 redactions: dict[str, int] | None = None) -> int:
    """The serving core's write for one request: its session (`new_session`, the keyword arguments of
    `session_row` but model, calls and tokens; inserted if new, else touched) and one call row per
    choice (`CALL_COLUMNS` but seq and link); returns the request's call number.

    The number (`seq`, shared by a request's choices) and whether a call extends its parent or branches
    from it are decided here, inside the write transaction, not from a gateway's memory: several
    gateway processes may serve one session. Touching the session row first locks it (PostgreSQL; on
    SQLite the writer's transaction is IMMEDIATE), so two processes cannot take the same number.

    `check_rollback` (canary promotion): a session created here by a call of a version rolled back
    meanwhile (routed before the rollback, recorded after it) is set aside at once, as the rollback did
    for the sessions stored before it. The check holds the policy row's share lock, so a rollback
    deciding just now waits for this write and then sets the session aside itself.

    `redactions`: what redaction found in this request's stored messages and replies, by type, added to
    the session's counts."""
    conn = db.connection()
    parent, link = rows[0]["parent_id"], rows[0]["link"]
    # The session's counts for the console's list: choices share the request's new prompt tokens.
    tokens = rows[0]["prompt_tokens"] - rows[0]["prefix_len"] + sum(row["completion_tokens"] for row in rows)
    session = None if new_session is None else session_row(**new_session, model=rows[0]["model"],
                                                          calls=len(rows), tokens=tokens)
    if session is not None and check_rollback and session["policy_version"] is not None and \
            _PROMOTION_LOCKED.execute(conn, {"v": session["policy_version"], "line": session["policy"]}
                                      ).fetchone() == (ROLLED_BACK,):
        session["skip_reason"] = ROLLED_BACK
    if session is not None and redactions:
        session["redactions"] = redactions
    if session is not None and add_session_if_absent(db, row=session):
        seq = 0  # created just now, in this transaction: it has no calls and no parent to contend for
    else:
        _TOUCH_SESSION.execute(conn, {"sid": session_id, "now": utcnow(), "n": len(rows), "t": tokens})
        if redactions:
            _add_redactions(conn, session_id, redactions)
        current = _NEXT_SEQ.execute(conn, {"sid": session_id}).fetchone()[0]
        seq = 0 if current is None else int(current) + 1
        if link == "extend" and parent is not None and \
                _CHAINED_CHILD.execute(conn, {"sid": session_id, "parent": parent}).fetchone() is not None:
            link = "branch"  # another process extended the parent first
    _INSERT_CALLS.execute(conn, [{"redactions": None, **row, "seq": seq, "link": link} for row in rows])
    return seq


def _add_redactions(conn: Connection, session_id: str, counts: dict[str, int]) -> None:
    """Add to a session's counts. The row is locked by the touch before (PostgreSQL; SQLite's writer holds
    the file), so reading and writing back loses no other process's counts."""
    stored = conn.execute(core_select(_SESSIONS.c.redactions).where(_SESSIONS.c.id == session_id)).scalar()
    merged = dict(stored or {})
    for kind, n in counts.items():
        merged[kind] = merged.get(kind, 0) + n
    conn.execute(update(_SESSIONS).where(_SESSIONS.c.id == session_id).values(redactions=merged))


def add_reward(db: Session, *, reward: Reward) -> None:
    """Store a reward event; the session's `reward` grows by its value (unless an admin overrode it),
    and a `final` one finishes the session."""
    db.add(reward)
    values: dict[str, Any] = {"reward": case((col(AgentSession.reward_override).is_(None),
                                              func.coalesce(col(AgentSession.reward), 0.0) + reward.value),
                                             else_=col(AgentSession.reward))}
    if reward.final:
        values |= {"status": "final", "updated_at": utcnow()}
    db.execute(update(AgentSession).where(col(AgentSession.id) == reward.session_id).values(**values)
               .execution_options(synchronize_session=False))
