"""Queries behind the console's JSON API: the filtered, sorted session list and capture quality.

The list filters and sorts on columns of `sessions` alone (first model, call and token counts, the
reward the trainer uses; kept by the writes and indexed), so a page costs the same with 100k sessions
as with 100; only the text search reads the calls' stored messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, cast, exists, false, or_, true
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, func, select

from tracetrain.store import leases
from tracetrain.store.models import CHAINED_LINKS, AgentSession, Call

SORTS = {"created": AgentSession.created_at, "updated": AgentSession.updated_at, "reward": AgentSession.reward,
         "calls": AgentSession.calls, "tokens": AgentSession.tokens}


@dataclass(frozen=True)
class SessionFilter:
    owner: str | None = None
    """Only this key's sessions (with `only_owner`)."""
    only_owner: bool = False
    status: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    group_id: str | None = None
    model: str | None = None
    text: str | None = None
    """Case-insensitive substring of any stored request message or reply of the session."""
    excluded: bool | None = None
    trained: bool | None = None


def _conditions(f: SessionFilter) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if f.only_owner:
        where.append(col(AgentSession.owner) == f.owner if f.owner is not None else col(AgentSession.owner).is_(None))
    if f.status is not None:
        where.append(col(AgentSession.status) == f.status)
    if f.reward_min is not None:
        where.append(col(AgentSession.reward) >= f.reward_min)
    if f.reward_max is not None:
        where.append(col(AgentSession.reward) <= f.reward_max)
    if f.group_id is not None:
        where.append(col(AgentSession.group_id) == f.group_id)
    if f.model is not None:
        where.append(col(AgentSession.model) == f.model)
    if f.excluded is not None:
        where.append(col(AgentSession.excluded).is_(true() if f.excluded else false()))
    if f.trained is not None:
        trained = col(AgentSession.trained_version)
        where.append(trained.is_not(None) if f.trained else trained.is_(None))
    if f.text:
        where.append(exists().where(col(Call.session_id) == col(AgentSession.id), or_(
            cast(col(Call.messages), String).icontains(f.text, autoescape=True),
            cast(col(Call.response_message), String).icontains(f.text, autoescape=True))))
    return where


def search_sessions(db: Session, *, where: SessionFilter, sort: str = "created", descending: bool = True,
                    limit: int = 50, offset: int = 0) -> tuple[Sequence[AgentSession], int]:
    """One page of sessions matching `where`, and how many match in all. Ties in the sort key go by id,
    so pages never overlap."""
    conditions = _conditions(where)
    key = col(SORTS[sort])
    ordered = key.desc() if descending else key.asc()
    if sort == "reward":  # sessions without a reward yet come last either way
        ordered = ordered.nulls_last()
    tie = col(AgentSession.id).desc() if descending else col(AgentSession.id).asc()
    order: list[ColumnElement[Any]] = [ordered, tie]
    page = db.exec(select(AgentSession).where(*conditions).order_by(*order).offset(offset).limit(limit)).all()
    if offset == 0 and len(page) < limit:
        return page, len(page)
    total = int(db.exec(select(func.count()).select_from(AgentSession).where(*conditions)).one())
    return page, total


def version_spans(db: Session, *, session_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(oldest, newest) policy version among each session's calls."""
    if not session_ids:
        return {}
    query = (select(Call.session_id, func.min(Call.policy_version), func.max(Call.policy_version))
             .where(col(Call.session_id).in_(session_ids)).group_by(col(Call.session_id)))
    return {sid: (int(lo), int(hi)) for sid, lo, hi in db.exec(query).all()}


def capture_stats(db: Session) -> dict[str, list[dict[str, Any]]]:
    """What the capture kept exact, per model and per key owner: calls by how they joined their
    session's chain, and sessions the trainer left unconsumed, by reason."""
    links = (select(Call.model, Call.owner, Call.link, func.count())
             .group_by(col(Call.model), col(Call.owner), col(Call.link)))
    by_source: dict[tuple[str, str | None], dict[str, int]] = {}
    for model, owner, link, n in db.exec(links).all():
        by_source.setdefault((model, owner), {})[link] = int(n)
    reason = leases.set_aside_reason()
    aside = (select(AgentSession.model, AgentSession.owner, reason, func.count()).where(leases.is_set_aside())
             .group_by(col(AgentSession.model), col(AgentSession.owner), reason))
    set_aside: dict[tuple[str | None, str | None], dict[str, int]] = {}
    for s_model, s_owner, why, n in db.exec(aside).all():
        set_aside.setdefault((s_model, s_owner), {})[str(why)] = int(n)
    rows: list[dict[str, Any]] = []
    for (model, owner), counts in sorted(by_source.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        calls = sum(counts.values())
        chained = sum(counts.get(link, 0) for link in CHAINED_LINKS)
        # A session's first call has nothing to extend; every later one could have.
        later = calls - counts.get("start", 0)
        rows.append({"model": model, "owner": owner, "calls": calls, "chained": chained,
                     "chained_share": chained / later if later else None,
                     "segment_starts": {link: n for link, n in sorted(counts.items()) if link not in CHAINED_LINKS},
                     "set_aside": set_aside.pop((model, owner), {})})
    for (s_model, s_owner), reasons in set_aside.items():  # sessions whose calls are all another model's
        rows.append({"model": s_model, "owner": s_owner, "calls": 0, "chained": 0, "chained_share": None,
                     "segment_starts": {}, "set_aside": reasons})
    return {"data": rows}


def status_counts(db: Session) -> dict[str, int]:
    """Sessions by status (`open`, `final`)."""
    query = select(AgentSession.status, func.count()).group_by(col(AgentSession.status))
    return {str(status): int(n) for status, n in db.exec(query).all()}
