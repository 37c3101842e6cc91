"""Queries behind the console's JSON API: the filtered, sorted session list and capture quality.

The list filters and sorts on columns of `sessions` alone (first model, call and token counts, the
reward the trainer uses; kept by the writes and indexed), so a page costs the same with 100k sessions
as with 100. The text search matches the calls' stored messages through an index (migration 0005):
on SQLite an FTS5 trigram table, on PostgreSQL trigram GIN indexes that its ILIKE uses by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, cast, column, exists, false, literal_column, or_, table, true
from sqlalchemy import text as sql_text
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, func, select

from tracetrain.store import leases
from tracetrain.store.messages import full_messages, shared_prefix
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
    """Case-insensitive substring of the JSON text of any stored request message or reply of the session
    (ASCII letters fold on SQLite; PostgreSQL's ILIKE folds by the database's locale)."""
    excluded: bool | None = None
    trained: bool | None = None
    policy: str | None = None
    """Only this named policy's sessions."""


def _conditions(f: SessionFilter) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if f.only_owner:
        where.append(col(AgentSession.owner) == f.owner if f.owner is not None else col(AgentSession.owner).is_(None))
    if f.policy is not None:
        where.append(col(AgentSession.policy) == f.policy)
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
    return where


# SQLite's index of the searched text (migration 0005): `call_search` is a contentless FTS5 table with
# the trigram tokenizer over the lower()-ed JSON text of each call's messages and reply; its rowid is
# `call_search_rows.id`, which names the call's session.
_CALL_SEARCH = table("call_search", column("rowid"))
_CALL_SEARCH_ROWS = table("call_search_rows", column("id"), column("session_id"))
_CALL_SEARCH_STATE = table("call_search_state", column("indexed_rowid"))
_HAS_CALL_SEARCH = sql_text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'call_search_state'")
TRIGRAM = 3
"""Shorter text has no trigram to look up: it is searched by scanning."""
COMMON_CALLS = 5000
"""A text in at least this many calls is common: a page of sessions newest first then finds its matches
sooner by scanning sessions in order (stopping at the page's end) than by collecting every match from
the index, whose cost grows with the matches (bench/console_render.py, in git history at af20f58)."""


def _contains(text: str) -> ColumnElement[bool]:
    """The call's messages or reply contain `text`, read from the row. Cast to TEXT, the expression of
    PostgreSQL's trigram indexes, so that its planner can use them."""
    return or_(cast(col(Call.messages), Text).icontains(text, autoescape=True),
               cast(col(Call.response_message), Text).icontains(text, autoescape=True))


def _scan(text: str) -> ColumnElement[bool]:
    """The session has a call whose text contains `text`, read row by row."""
    return exists().where(col(Call.session_id) == col(AgentSession.id), _contains(text))


def _match(text: str) -> ColumnElement[bool]:
    """FTS5's MATCH of `text` as one phrase: with the trigram tokenizer, a substring of a column. Lower-cased
    by SQLite's lower(), as the indexed text was, so a match is exactly a match of `_scan`."""
    phrase = '"' + text.replace('"', '""') + '"'
    return literal_column("call_search").bool_op("MATCH")(func.lower(phrase))


def _indexed(text: str) -> ColumnElement[bool]:
    """`_scan`'s condition through SQLite's index: the sessions of the calls whose text matches, and of the
    calls not indexed yet (past the mark, store/search_index.py) whose text matches when read."""
    calls = select(_CALL_SEARCH.c.rowid).where(_match(text))
    indexed = select(_CALL_SEARCH_ROWS.c.session_id).where(_CALL_SEARCH_ROWS.c.id.in_(calls))
    mark = select(_CALL_SEARCH_STATE.c.indexed_rowid).scalar_subquery()
    recent = select(Call.session_id).where(literal_column("calls.rowid") > mark, _contains(text))
    return or_(col(AgentSession.id).in_(indexed), col(AgentSession.id).in_(recent))


def _text_conditions(db: Session, text: str) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    """How to search `text`: (the condition for a page, the condition for counting every match)."""
    if (db.get_bind().dialect.name != "sqlite" or len(text) < TRIGRAM
            or db.connection().execute(_HAS_CALL_SEARCH).first() is None):
        return _scan(text), _scan(text)  # PostgreSQL's planner picks index or scan by itself
    probe = select(func.count()).select_from(select(_CALL_SEARCH.c.rowid).where(_match(text))
                                             .limit(COMMON_CALLS).subquery())
    common = int(db.exec(probe).one()) >= COMMON_CALLS
    return (_scan(text) if common else _indexed(text)), _indexed(text)


def search_sessions(db: Session, *, where: SessionFilter, sort: str = "created", descending: bool = True,
                    limit: int = 50, offset: int = 0) -> tuple[Sequence[AgentSession], int]:
    """One page of sessions matching `where`, and how many match in all. Ties in the sort key go by id,
    so pages never overlap."""
    conditions = counted = _conditions(where)
    if where.text:
        on_page, on_count = _text_conditions(db, where.text)
        conditions, counted = [*conditions, on_page], [*conditions, on_count]
    key = col(SORTS[sort])
    ordered = key.desc() if descending else key.asc()
    if sort == "reward":  # sessions without a reward yet come last either way
        ordered = ordered.nulls_last()
    tie = col(AgentSession.id).desc() if descending else col(AgentSession.id).asc()
    order: list[ColumnElement[Any]] = [ordered, tie]
    page = db.exec(select(AgentSession).where(*conditions).order_by(*order).offset(offset).limit(limit)).all()
    if offset == 0 and len(page) < limit:
        return page, len(page)
    total = int(db.exec(select(func.count()).select_from(AgentSession).where(*counted)).one())
    return page, total


def version_spans(db: Session, *, session_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(oldest, newest) policy version among each session's calls."""
    if not session_ids:
        return {}
    query = (select(Call.session_id, func.min(Call.policy_version), func.max(Call.policy_version))
             .where(col(Call.session_id).in_(session_ids)).group_by(col(Call.session_id)))
    return {sid: (int(lo), int(hi)) for sid, lo, hi in db.exec(query).all()}


def added_messages(calls: Sequence[Call]) -> dict[str, list[dict[str, Any]]]:
    """For each of a session's calls, the request messages it added to its parent call's conversation, as
    the client sent them: the tool results and user turns that came after the parent's reply. A call that
    extends or branches from its parent resent that reply first, token for token (the chain checked
    it), so it is left out: the reply is the parent's. A first call added its whole request."""
    by_id = {call.id: call for call in calls}
    full: dict[str, list[dict[str, Any]]] = {}

    def messages(call: Call) -> list[dict[str, Any]]:
        if call.id not in full:
            try:
                full[call.id] = full_messages(call, by_id)
            except LookupError:  # an ancestor is missing: what the row stores is all there is
                full[call.id] = list(call.messages)
        return full[call.id]

    added: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        sent = messages(call)
        parent = by_id.get(call.parent_id) if call.parent_id else None
        if parent is None:
            added[call.id] = sent
            continue
        before = messages(parent)
        start = shared_prefix(before, sent)
        if (start == len(before) and call.link in CHAINED_LINKS and start < len(sent)
                and sent[start].get("role") == "assistant"):
            start += 1
        added[call.id] = sent[start:]
    return added


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


def status_counts(db: Session, *, policy: str | None = None) -> dict[str, int]:
    """Sessions by status (`open`, `final`), of named policy `policy` (None: of every policy)."""
    query = select(AgentSession.status, func.count()).group_by(col(AgentSession.status))
    if policy is not None:
        query = query.where(AgentSession.policy == policy)
    return {str(status): int(n) for status, n in db.exec(query).all()}
