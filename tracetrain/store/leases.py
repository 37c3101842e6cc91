"""Trainer claims on finished sessions, and what is left for other uses.

A session an admin excluded is never ready (until it is included again). A session with a final
reward is *ready* until a trainer either consumes it (`trained_version` set:
the step that produced that version learned from it) or sets it aside (`skip_reason` set,
`trained_version` still empty: the online trainer cannot use it, e.g. `stale` or `zero_variance`,
but it stays in the store for off-policy and offline algorithms and for export).

Claims take whole groups, freshest first (the highest oldest-policy-version, then the latest
finish), so GRPO-style baselines see every member and the trainer learns from what is most on
policy. A claim is a conditional UPDATE (atomic on SQLite and PostgreSQL alike) that sets a lease:
several trainers never train the same row, and a crashed trainer's lease simply runs out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import and_, case, exists, false, or_, update
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, func, select

from tracetrain.store.models import DEFAULT_POLICY, NO_TRAIN_REASONS, AgentSession, Call, Policy, utcnow


def _unused(*, include_set_aside: bool = False) -> ColumnElement[bool]:
    """Final, not consumed, not excluded by an admin and its content not purged; not set aside either, unless
    `include_set_aside`."""
    unused = and_(col(AgentSession.status) == "final", col(AgentSession.trained_version).is_(None),
                  col(AgentSession.excluded).is_(false()), col(AgentSession.purged).is_(None))
    return unused if include_set_aside else and_(unused, col(AgentSession.skip_reason).is_(None))


def _lease_free(now: datetime) -> ColumnElement[bool]:
    return or_(col(AgentSession.lease_until).is_(None), col(AgentSession.lease_until) < now)


@dataclass(frozen=True)
class ReadySession:
    id: str
    group_id: str
    oldest_version: int
    """The oldest policy version among the session's calls: its staleness."""
    finished_at: datetime


def ready_sessions(db: Session, *, min_version: int | None = None, include_set_aside: bool = False,
                   policy: str = DEFAULT_POLICY) -> list[ReadySession]:
    """Unleased ready sessions of named policy `policy` (with their oldest policy version, in that policy's
    numbering), at or above `min_version` if given; with `include_set_aside`, also those the online trainer set
    aside (for SFT and DPO)."""
    oldest = select(func.min(Call.policy_version)).where(Call.session_id == AgentSession.id).scalar_subquery()
    query = select(AgentSession.id, AgentSession.group_id, oldest, AgentSession.updated_at).where(
        AgentSession.policy == policy, _unused(include_set_aside=include_set_aside), _lease_free(utcnow()))
    if min_version is not None:
        query = query.where(oldest >= min_version)
    return [ReadySession(i, g, int(v or 0), _aware(t)) for i, g, v, t in db.exec(query).all()]


def _aware(moment: datetime) -> datetime:
    """SQLite and PostgreSQL hand back the stored UTC times without a zone."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def busy_groups(db: Session, *, group_ids: Sequence[str], active_since: datetime) -> set[str]:
    """Of `group_ids`, those with an open session that made a call after `active_since`."""
    query = select(AgentSession.group_id).where(
        col(AgentSession.group_id).in_(group_ids), AgentSession.status == "open",
        col(AgentSession.updated_at) >= active_since).distinct()
    return set(db.exec(query).all())


def pick_groups(sessions: Sequence[ReadySession], *, busy: set[str], settled_before: datetime, want: int) -> list[str]:
    """Session ids of whole groups, freshest group first, until there are at least `want` (so at most
    one group's worth beyond it when group sizes do not add up to `want`).

    A busy group (a member still open) waits, so its baseline sees every member, unless its first
    member finished before `settled_before`: an abandoned member, or an agent that keeps one group
    open all the time, cannot hold it back for long.
    """
    groups: dict[str, list[ReadySession]] = {}
    for session in sessions:
        groups.setdefault(session.group_id, []).append(session)
    ready = [members for group, members in groups.items()
             if group not in busy or min(m.finished_at for m in members) < settled_before]
    ready.sort(key=lambda members: (min(m.oldest_version for m in members), max(m.finished_at for m in members)),
               reverse=True)
    picked: list[str] = []
    for members in ready:
        if len(picked) >= want:
            break
        picked += [m.id for m in members]
    return picked


def claim_groups(db: Session, *, trainer_id: str, want: int, lease_s: float, min_version: int | None,
                 settle_s: float, include_set_aside: bool = False, policy: str = DEFAULT_POLICY) -> list[str]:
    """Lease whole ready groups of named policy `policy`, freshest first, about `want` sessions; returns the
    ids this trainer got."""
    sessions = ready_sessions(db, min_version=min_version, include_set_aside=include_set_aside, policy=policy)
    if not sessions:
        return []
    since = utcnow() - timedelta(seconds=settle_s)
    busy = busy_groups(db, group_ids=sorted({s.group_id for s in sessions}), active_since=since)
    ids = pick_groups(sessions, busy=busy, settled_before=since, want=want)
    return _lease(db, trainer_id=trainer_id, session_ids=ids, lease_s=lease_s)


def claim_sessions(db: Session, *, trainer_id: str, limit: int, lease_s: float) -> list[str]:
    """Lease up to `limit` ready sessions, oldest finish first, regardless of groups and staleness
    (offline consumers: SFT over the store, export jobs)."""
    query = (select(AgentSession.id).where(_unused(), _lease_free(utcnow()))
             .order_by(col(AgentSession.updated_at)).limit(limit))
    return _lease(db, trainer_id=trainer_id, session_ids=list(db.exec(query).all()), lease_s=lease_s)


def _lease(db: Session, *, trainer_id: str, session_ids: list[str], lease_s: float) -> list[str]:
    if not session_ids:
        return []
    now = utcnow()
    until = now + timedelta(seconds=lease_s)
    # Checked again in the update: an admin may have excluded (or a purge cleared) a session since the select.
    db.execute(update(AgentSession).where(col(AgentSession.id).in_(session_ids), _lease_free(now),
                                          col(AgentSession.excluded).is_(false()), col(AgentSession.purged).is_(None))
               .values(lease_owner=trainer_id, lease_until=until))
    db.commit()
    # Another trainer may have won some of them between the select and the update.
    mine = select(AgentSession.id).where(col(AgentSession.id).in_(session_ids),
                                         col(AgentSession.lease_owner) == trainer_id,
                                         col(AgentSession.lease_until) == until)
    return list(db.exec(mine).all())


def set_aside_stale(db: Session, *, min_version: int, policy: str = DEFAULT_POLICY) -> int:
    """Set aside every unleased ready session of named policy `policy` with a call older than `min_version` (a
    version of that policy's line); returns how many. Versions only grow, so a stale session can never become
    usable by the online trainer again."""
    older = exists().where(col(Call.session_id) == col(AgentSession.id), col(Call.policy_version) < min_version)
    result = db.execute(update(AgentSession).where(col(AgentSession.policy) == policy, _unused(), _lease_free(utcnow()),
                                                   older)
                        .values(skip_reason="stale").execution_options(synchronize_session=False))
    db.commit()
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def set_aside(db: Session, *, trainer_id: str, session_ids: Sequence[str], reason: str) -> None:
    """Release this trainer's lease on `session_ids` and set them aside for `reason`, unconsumed."""
    if not session_ids:
        return
    db.execute(update(AgentSession)
               .where(col(AgentSession.id).in_(session_ids), col(AgentSession.lease_owner) == trainer_id)
               .values(skip_reason=reason, lease_owner=None, lease_until=None))
    db.commit()


def release_sessions(db: Session, *, trainer_id: str, session_ids: Sequence[str]) -> None:
    db.execute(update(AgentSession)
               .where(col(AgentSession.id).in_(session_ids), col(AgentSession.lease_owner) == trainer_id)
               .values(lease_owner=None, lease_until=None))
    db.commit()


def consume_sessions(db: Session, *, trainer_id: str, session_ids: Sequence[str], version: int) -> None:
    """Mark sessions as learned from by the step that produced `version`."""
    if not session_ids:
        return
    db.execute(update(AgentSession)
               .where(col(AgentSession.id).in_(session_ids), col(AgentSession.lease_owner) == trainer_id)
               .values(trained_version=version, lease_owner=None, lease_until=None))
    db.commit()


def set_aside_reason() -> ColumnElement[str]:
    """Why an unconsumed session was left out: its `no_train_*` reason when it is not for training, else
    `purged` when its content is gone (retention or erasure), else `excluded` when an admin excluded it,
    whatever the trainer said of it before, else the trainer's `skip_reason`."""
    return case((col(AgentSession.skip_reason).in_(NO_TRAIN_REASONS), col(AgentSession.skip_reason)),
                (col(AgentSession.purged).is_not(None), "purged"),
                (col(AgentSession.excluded).is_(True), "excluded"), else_=col(AgentSession.skip_reason))


def is_set_aside() -> ColumnElement[bool]:
    """Not consumed, and either set aside by the trainer, excluded by an admin or purged."""
    return and_(col(AgentSession.trained_version).is_(None),
                or_(col(AgentSession.skip_reason).is_not(None), col(AgentSession.excluded).is_(True),
                    col(AgentSession.purged).is_not(None)))


def set_aside_counts(db: Session, *, policy: str | None = None) -> dict[str, int]:
    """Sessions left unconsumed in the store (of named policy `policy`; None: of every policy), by
    `set_aside_reason`."""
    reason = set_aside_reason()
    query = select(reason, func.count()).where(is_set_aside()).group_by(reason)
    if policy is not None:
        query = query.where(AgentSession.policy == policy)
    return {str(why): int(n) for why, n in db.exec(query).all()}


def latest_policy(db: Session, *, line: str = DEFAULT_POLICY) -> Policy | None:
    """`line`'s newest version (None: it has none recorded, so its version 0, the base model)."""
    return db.exec(select(Policy).where(Policy.line == line).order_by(col(Policy.version).desc()).limit(1)).first()


def recent_policy_times(db: Session, *, limit: int, line: str = DEFAULT_POLICY) -> list[datetime]:
    """Creation times of `line`'s latest `limit` versions, newest first (the trainer's step rate)."""
    query = select(Policy.created_at).where(Policy.line == line, Policy.version > 0).order_by(
        col(Policy.version).desc()).limit(limit)
    return list(db.exec(query).all())


def ready_count(db: Session, *, policy: str | None = None) -> int:
    """Ready sessions no trainer has claimed yet (of named policy `policy`; None: of every policy)."""
    query = select(func.count()).select_from(AgentSession).where(_unused(), _lease_free(utcnow()))
    if policy is not None:
        query = query.where(AgentSession.policy == policy)
    return int(db.exec(query).one())


def ready_counts(db: Session) -> dict[str, int]:
    """Ready unclaimed sessions by named policy (policies with none are left out): the trainer's scheduler."""
    query = select(AgentSession.policy, func.count()).where(_unused(), _lease_free(utcnow())).group_by(
        AgentSession.policy)
    return {str(policy): int(n) for policy, n in db.exec(query).all()}


def leased_count(db: Session, *, policy: str | None = None) -> int:
    """Ready sessions a trainer has claimed for a step that has not finished (its lease still runs)."""
    query = select(func.count()).select_from(AgentSession).where(_unused(), col(AgentSession.lease_until) >= utcnow())
    if policy is not None:
        query = query.where(AgentSession.policy == policy)
    return int(db.exec(query).one())
