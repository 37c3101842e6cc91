"""The weights each vLLM replica holds, and full-weight reloads agreed between gateway processes.

A reload changes a replica's weights in place, so every gateway process sending to it must stop first:
a call sent meanwhile would run on the new weights under the old version label. The process reloading
claims the replica (`claim_reload`, one claim at a time, under a lease it renews); every other live
process (`heartbeat`) takes the replica out of its routing, waits for its own calls there to finish
and acknowledges (`acknowledge`); once `acknowledged_by` covers every live process the owner reloads,
then `finish_reload` records the replica's new version, which every process labels its calls with
before it routes to the replica again.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, timedelta
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, or_, select

from tracetrain.store.models import GatewayProcess, ReplicaAck, ReplicaState, utcnow


def _insert(db: Session, table: type[Any]) -> Any:
    """An INSERT with ON CONFLICT for this store's dialect."""
    return (postgresql if db.get_bind().dialect.name == "postgresql" else sqlite).insert(table)


FORGOTTEN_AFTER = timedelta(hours=1)
"""Processes silent this long (they died without unregistering) are deleted by the next heartbeat."""


def heartbeat(db: Session, *, process: str) -> None:
    """Mark `process` alive now."""
    now = utcnow()
    insert = _insert(db, GatewayProcess).values(id=process, heartbeat_at=now)
    db.execute(insert.on_conflict_do_update(index_elements=["id"], set_={"heartbeat_at": now}))
    db.execute(delete(GatewayProcess).where(col(GatewayProcess.heartbeat_at) < now - FORGOTTEN_AFTER))


def forget_process(db: Session, *, process: str) -> None:
    """A process stopping: nobody waits for its acknowledgements any more."""
    db.execute(delete(GatewayProcess).where(col(GatewayProcess.id) == process))


def live_processes(db: Session, *, within_s: float) -> Sequence[str]:
    """Processes whose last heartbeat is at most `within_s` old."""
    since = utcnow() - timedelta(seconds=within_s)
    return db.exec(select(GatewayProcess.id).where(col(GatewayProcess.heartbeat_at) > since)).all()


def states(db: Session) -> dict[str, ReplicaState]:
    """Every replica the store knows, by URL."""
    return {state.url: state for state in db.exec(select(ReplicaState)).all()}


def claim_reload(db: Session, *, url: str, version: int, owner: str, ttl_s: float) -> int | None:
    """Claim `url` for reloading it to `version`; returns the claim's epoch, or None while another live
    claim holds it. A lapsed claim (its owner died) may be taken over."""
    db.execute(_insert(db, ReplicaState)
               .values(url=url, version=0, epoch=0, updated_at=utcnow())
               .on_conflict_do_nothing(index_elements=["url"]))
    now = utcnow()
    claimed = db.execute(
        update(ReplicaState)
        .where(col(ReplicaState.url) == url,
               or_(col(ReplicaState.reloading_to).is_(None), col(ReplicaState.expires_at) <= now))
        .values(epoch=ReplicaState.epoch + 1, reloading_to=version, owner=owner,
                expires_at=now + timedelta(seconds=ttl_s), updated_at=now)
        .returning(col(ReplicaState.epoch))
    ).first()
    return None if claimed is None else int(claimed[0])


def renew_claim(db: Session, *, url: str, epoch: int, ttl_s: float) -> bool:
    """Extend a claim's lease; False if it is no longer this claim (it lapsed and was taken over)."""
    now = utcnow()
    result = db.execute(update(ReplicaState)
                        .where(col(ReplicaState.url) == url, col(ReplicaState.epoch) == epoch,
                               col(ReplicaState.reloading_to).is_not(None))
                        .values(expires_at=now + timedelta(seconds=ttl_s)))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def acknowledge(db: Session, *, url: str, epoch: int, process: str) -> None:
    """`process` sends nothing to `url` until the claim `epoch` is finished."""
    insert = _insert(db, ReplicaAck).values(url=url, epoch=epoch, process=process)
    db.execute(insert.on_conflict_do_nothing())


def acknowledged_by(db: Session, *, url: str, epoch: int) -> set[str]:
    query = select(ReplicaAck.process).where(col(ReplicaAck.url) == url, col(ReplicaAck.epoch) == epoch)
    return set(db.exec(query).all())


def finish_reload(db: Session, *, url: str, epoch: int, version: int | None, checkpoint: str | None = None,
                  failure: str | None = None) -> None:
    """End the claim `epoch`: the replica now holds `version` from `checkpoint`, or (`version` None) still
    holds what it held, after a reload that failed or never began. Processes may route to it again,
    unless `failure` says why not."""
    values: dict[str, Any] = {"reloading_to": None, "owner": None, "expires_at": None, "failure": failure,
                              "updated_at": utcnow()}
    if version is not None:
        values.update(version=version, checkpoint=checkpoint)
    db.execute(update(ReplicaState)
               .where(col(ReplicaState.url) == url, col(ReplicaState.epoch) == epoch).values(**values))
    db.execute(delete(ReplicaAck).where(col(ReplicaAck.url) == url, col(ReplicaAck.epoch) <= epoch))


def claim_lapsed(state: ReplicaState) -> bool:
    """Whether a reload under way outlived its lease (its owner stopped renewing it: it died)."""
    if state.reloading_to is None or state.expires_at is None:
        return False
    expires = state.expires_at if state.expires_at.tzinfo else state.expires_at.replace(tzinfo=UTC)
    return expires <= utcnow()


def reset(db: Session, *, url: str, version: int = 0) -> None:
    """A replica that restarted holds its server's own weights again (`version` 0) until it catches up."""
    db.execute(_insert(db, ReplicaState)
               .values(url=url, version=version, epoch=0, updated_at=utcnow())
               .on_conflict_do_update(index_elements=["url"],
                                      set_={"version": version, "checkpoint": None, "reloading_to": None,
                                            "owner": None, "expires_at": None, "updated_at": utcnow()}))
