"""Small keyword-only queries over the store; each takes an open session."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, bindparam, case, insert, update
from sqlalchemy import select as core_select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlmodel import Session, col, func, select

from tracetrain.store.models import AgentSession, Call, Policy, Reward, utcnow


def get_session(db: Session, *, session_id: str) -> AgentSession | None:
    return db.get(AgentSession, session_id)


# The serving core's per-call statements, built once: a statement built per call with its values
# inlined costs a cache-key walk and often a compile (a fifth of the gateway's CPU per call, profiled).
# They run on the session's connection (Core), which also skips the ORM's per-statement work.
_SESSIONS: Table = AgentSession.__table__  # type: ignore[attr-defined]
_CALLS: Table = Call.__table__  # type: ignore[attr-defined]
_INSERT_SESSION = {name: dialect.insert(_SESSIONS).on_conflict_do_nothing() for name, dialect in
                   (("postgresql", postgresql), ("sqlite", sqlite))}
_TOUCH_SESSION = update(_SESSIONS).where(_SESSIONS.c.id == bindparam("sid")).values(
    updated_at=bindparam("now"), calls=_SESSIONS.c.calls + bindparam("n"), tokens=_SESSIONS.c.tokens + bindparam("t"))
_NEXT_SEQ = core_select(func.max(_CALLS.c.seq)).where(_CALLS.c.session_id == bindparam("sid"))
_CHAINED_CHILD = core_select(_CALLS.c.id).where(
    _CALLS.c.session_id == bindparam("sid"), _CALLS.c.parent_id == bindparam("parent"),
    _CALLS.c.link.in_(["extend", "branch"])).limit(1)
_INSERT_CALLS = insert(_CALLS)
_SESSION_OWNER = core_select(_SESSIONS.c.owner, _SESSIONS.c.group_id, _SESSIONS.c.policy_version).where(
    _SESSIONS.c.id == bindparam("sid"))


def add_session_if_absent(db: Session, *, session: AgentSession, **values: Any) -> bool:
    """Insert `session` (with column `values` over its own) unless its id exists (two first calls of
    one session may race): one INSERT … ON CONFLICT DO NOTHING. True when this insert created it."""
    statement = _INSERT_SESSION["postgresql" if db.get_bind().dialect.name == "postgresql" else "sqlite"]
    return db.connection().execute(statement, {**session.model_dump(), **values}).rowcount == 1


def session_owner_group(conn: Connection, *, session_id: str) -> tuple[str | None, str, int | None] | None:
    """(owner, group, version it started on) of a stored session, or None: the gateway's check on every
    call of a session it has not cached. On a bare connection: an ORM session's transaction bookkeeping
    cost more than the query (profiled)."""
    row = conn.execute(_SESSION_OWNER, {"sid": session_id}).first()
    return None if row is None else (row[0], row[1], row[2])


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


def next_seq(db: Session, *, session_id: str) -> int:
    current = db.exec(select(func.max(Call.seq)).where(Call.session_id == session_id)).one()
    return 0 if current is None else int(current) + 1


def reward_by_key(db: Session, *, session_id: str, idempotency_key: str) -> Reward | None:
    query = select(Reward).where(Reward.session_id == session_id, Reward.idempotency_key == idempotency_key)
    return db.exec(query).first()


def all_session_ids(db: Session) -> Sequence[str]:
    return db.exec(select(AgentSession.id).order_by(col(AgentSession.created_at))).all()


def latest_call_id(db: Session, *, session_id: str) -> str | None:
    query = select(Call.id).where(Call.session_id == session_id).order_by(col(Call.seq).desc())
    return db.exec(query.limit(1)).first()


def latest_published(db: Session) -> Policy | None:
    """The newest version a trainer published (to any gateway on this store)."""
    query = select(Policy).where(col(Policy.published_at).is_not(None)).order_by(col(Policy.version).desc())
    return db.exec(query.limit(1)).first()


def list_policies(db: Session) -> Sequence[Policy]:
    return db.exec(select(Policy).order_by(col(Policy.version))).all()


def record_calls(db: Session, *, session_id: str, new_session: AgentSession | None, rows: list[dict[str, Any]]) -> int:
    """The serving core's write for one request: its session (inserted if new, else touched) and one
    call row per choice; returns the request's call number.

    The number (`seq`, shared by a request's choices) and whether a call extends its parent or branches
    from it are decided here, inside the write transaction, not from a gateway's memory: several
    gateway processes may serve one session. Touching the session row first locks it (PostgreSQL; on
    SQLite the writer's transaction is IMMEDIATE), so two processes cannot take the same number."""
    conn = db.connection()
    parent, link = rows[0]["parent_id"], rows[0]["link"]
    # The session's counts for the console's list: choices share the request's new prompt tokens.
    tokens = rows[0]["prompt_tokens"] - rows[0]["prefix_len"] + sum(row["completion_tokens"] for row in rows)
    if new_session is not None and add_session_if_absent(db, session=new_session, model=rows[0]["model"],
                                                         calls=len(rows), tokens=tokens):
        seq = 0  # created just now, in this transaction: it has no calls and no parent to contend for
    else:
        conn.execute(_TOUCH_SESSION, {"sid": session_id, "now": utcnow(), "n": len(rows), "t": tokens})
        current = conn.execute(_NEXT_SEQ, {"sid": session_id}).scalar()
        seq = 0 if current is None else int(current) + 1
        if link == "extend" and parent is not None and \
                conn.execute(_CHAINED_CHILD, {"sid": session_id, "parent": parent}).first() is not None:
            link = "branch"  # another process extended the parent first
    conn.execute(_INSERT_CALLS, [{**row, "seq": seq, "link": link} for row in rows])
    return seq


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
