"""Which versions serve, as the store records it: every gateway process on the store follows this.

A published version is `immediate` (everyone gets it at once) or, under canary promotion, a `canary`
until it is `promoted` or `rolled_back`. The incumbent is the newest `immediate` or `promoted` one.
Each policy line (the default one and every named policy, decision 13) has its own incumbent and canary.

A rolled-back version's sessions are not trained on: they are set aside with the reason `rolled_back`
(kept in the store, counted by `GET /v1/policies`, exported like any other), because they sample a
policy the trainer no longer continues from.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, false, select

from tracetrain.store import leases
from tracetrain.store.models import DEFAULT_POLICY, AgentSession, Policy, utcnow

SERVING = ("immediate", "promoted")
ROLLED_BACK = "rolled_back"


def incumbent(db: Session, *, line: str = DEFAULT_POLICY) -> Policy | None:
    """`line`'s newest version served to everyone (None: the base model)."""
    query = select(Policy).where(Policy.line == line, col(Policy.promotion).in_(SERVING)).order_by(
        col(Policy.version).desc())
    return db.exec(query.limit(1)).first()


def canary(db: Session, *, line: str = DEFAULT_POLICY) -> Policy | None:
    """`line`'s version on trial, if any (the newest, should two have been staged)."""
    query = select(Policy).where(Policy.line == line, Policy.promotion == "canary").order_by(
        col(Policy.version).desc())
    return db.exec(query.limit(1)).first()


def version_row(db: Session, *, line: str = DEFAULT_POLICY, version: int) -> Policy | None:
    return db.get(Policy, (line, version))


def record_trained(db: Session, *, line: str, version: int, checkpoint: Path, kind: str, metrics: dict[str, Any],
                   trainer_id: str, session_ids: Sequence[str]) -> None:
    """Record a version a trainer wrote and mark the sessions it learned from consumed, in one transaction: a
    trainer killed after this (while publishing, say) leaves no lease to lapse on sessions the recorded version
    learned from, so the next trainer, resuming from this version, cannot train them a second time."""
    db.add(Policy(line=line, version=version, checkpoint=str(checkpoint.resolve()), kind=kind, metrics=metrics))
    db.flush()
    leases.consume_sessions(db, trainer_id=trainer_id, session_ids=session_ids, version=version)
    db.commit()  # consume_sessions committed both, unless it had no sessions to mark


def record_publish(db: Session, *, line: str, version: int, error: str | None, seconds: float) -> None:
    """How a trainer's hand-over of `version` to the engine went: `published_at` when it was served (None after
    a failure, with `publish_error`), and the time it took among the version's step times."""
    policy = version_row(db, line=line, version=version)
    if policy is None:
        return
    # A gateway that served it has dated it already, before its reply reached the trainer: keep that.
    policy.published_at = None if error else _served_from(policy, policy.published_at or utcnow())
    policy.publish_error = error
    times = {**policy.metrics.get("time_s", {}), "publish": seconds}
    policy.metrics = {**policy.metrics, "publish_seconds": seconds, "time_s": times}
    db.add(policy)
    db.commit()


def _served_from(policy: Policy, at: datetime) -> datetime:
    """When `policy` began serving: `at` (its hand-over to the engine ended), or its first call if one was
    recorded before that was written, since a recorded call proves it was serving by then."""
    first = policy.first_call_at
    if first is not None and first.replace(tzinfo=None) < at.replace(tzinfo=None):
        return first
    return at


def mark_published(db: Session, *, version: int, checkpoint: Path, kind: str, promotion: str,
                   line: str = DEFAULT_POLICY, at: datetime | None = None) -> datetime | None:
    """Record that `version` now serves as `immediate` or `canary`; returns a canary's start. A canary needs
    a row for its decision, made here if the trainer made none; an immediate version is recorded by its
    trainer."""
    policy = version_row(db, line=line, version=version)
    if policy is None:
        if promotion != "canary":
            return None
        policy = Policy(line=line, version=version, checkpoint=str(checkpoint), kind=kind)
    policy.promotion = promotion
    policy.published_at = policy.published_at or _served_from(policy, at or utcnow())
    if promotion == "canary":
        policy.canary_since = utcnow()
    db.add(policy)
    db.commit()
    return policy.canary_since


def record_probes(db: Session, *, version: int, probes: dict[str, Any], line: str = DEFAULT_POLICY) -> None:
    """Add the publish probe's figures by replica to `version`'s row (engines/probe.py)."""
    policy = version_row(db, line=line, version=version)
    if policy is not None:
        policy.probes = {**(policy.probes or {}), **probes}
        db.add(policy)


def record_first_call(db: Session, *, version: int, at: datetime, line: str = DEFAULT_POLICY) -> None:
    """`version` served its first call at `at`, unless an earlier one (another gateway process) is recorded."""
    db.execute(update(Policy).where(col(Policy.line) == line, col(Policy.version) == version,
                                    col(Policy.first_call_at).is_(None))
               .values(first_call_at=at))
    # A publish dated after the call (its hand-over was written later) began serving by the call.
    db.execute(update(Policy).where(col(Policy.line) == line, col(Policy.version) == version,
                                    col(Policy.published_at) > at)
               .values(published_at=at))


def arm_rewards(db: Session, *, version: int, since: datetime, line: str = DEFAULT_POLICY) -> list[float]:
    """Final rewards of `line`'s sessions that began on `version` at or after `since` (excluded ones left out)."""
    query = select(AgentSession.reward).where(
        AgentSession.policy == line, AgentSession.policy_version == version,
        col(AgentSession.created_at) >= since,
        AgentSession.status == "final", col(AgentSession.reward).is_not(None),
        col(AgentSession.excluded).is_(false()))
    return [float(r) for r in db.exec(query).all() if r is not None]


def lines_published(db: Session) -> list[str]:
    """The lines with a version served or on trial."""
    query = select(Policy.line).where(col(Policy.promotion).in_((*SERVING, "canary"))).distinct()
    return sorted(db.exec(query).all())


def decide(db: Session, *, version: int, outcome: str, decision: dict[str, Any],
           line: str = DEFAULT_POLICY) -> bool:
    """Promote or roll back a canary, once: False when it was decided already (another gateway process,
    an admin). Rolling back sets its unconsumed sessions aside."""
    if outcome not in ("promoted", ROLLED_BACK):
        raise ValueError(f"unknown canary outcome {outcome!r}")
    decided = db.execute(
        update(Policy).where(col(Policy.line) == line, col(Policy.version) == version,
                             col(Policy.promotion) == "canary")
        .values(promotion=outcome, decided_at=utcnow(), decision=decision)
        .execution_options(synchronize_session=False)).rowcount == 1  # type: ignore[attr-defined]
    if decided and outcome == ROLLED_BACK:
        db.execute(update(AgentSession).where(
            col(AgentSession.policy) == line, col(AgentSession.policy_version) == version,
            col(AgentSession.trained_version).is_(None),
            col(AgentSession.skip_reason).is_(None)).values(skip_reason=ROLLED_BACK)
            .execution_options(synchronize_session=False))
    db.commit()
    return decided

