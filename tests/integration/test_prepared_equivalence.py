"""The store's prepared statements (store/prepared.py) against plain SQLAlchemy Core, on SQLite and PostgreSQL.

A `Prepared` statement is compiled once and run on the driver's cursor with the bind processors it took
from SQLAlchemy's compiler. The reference is the same statement object (`Prepared.statement`) run the
plain way, `conn.execute(statement, params)`: the same random rows written through each path into two
fresh stores must leave identical rows, and the same reads must give identical results.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, cast

import pytest
from sqlalchemy import JSON, Table
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql import Executable
from sqlmodel import Session

from tests.support.servers import PostgresCluster
from tracetrain.store import queries
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Call, Policy
from tracetrain.store.prepared import Prepared

ROUNDS = 25
"""Random rounds per dialect; each writes a few sessions and calls and runs every read."""

_SESSIONS: Table = AgentSession.__table__  # type: ignore[attr-defined]
_CALLS: Table = Call.__table__  # type: ignore[attr-defined]
_POLICIES: Table = Policy.__table__  # type: ignore[attr-defined]

# Text that a driver or an encoder could get wrong: quotes, backslashes, NUL-free control characters,
# combining marks, astral characters, right-to-left text and SQL's own syntax.
_TEXT = ["a", "Z", " ", "'", '"', "\\", "%", "?", ":x", "$1", "\n", "\t", "é", "e\u0301", "日本", "🙂", "𝔘",
         "\u202e", "שלום", "--", ";", "DROP", "\u00a0", "\x7f"]
_INT32 = (-(2**31), 2**31 - 1)
_FLOATS = [0.0, -0.0, 1.5, -2.25, 1e-300, -1e300, 3.141592653589793, 2**53 + 1.0, float("inf"), float("-inf")]
_POLICY_STATES = [None, "immediate", "canary", "promoted", "rolled_back"]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def two_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Engine, Engine]]:
    """Two fresh, empty stores of one dialect: the first written through `Prepared`, the second through Core."""
    if request.param == "sqlite":
        urls = [f"sqlite:///{tmp_path / 'prepared.db'}", f"sqlite:///{tmp_path / 'reference.db'}"]
    else:
        cluster: PostgresCluster = request.getfixturevalue("postgres")
        urls = [cluster.create_database(f"t_{uuid.uuid4().hex[:12]}") for _ in range(2)]
    dbs = [open_db(url) for url in urls]
    yield dbs[0], dbs[1]
    for db in dbs:
        db.dispose()


def _text(rng: random.Random, most: int = 40) -> str:
    return "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, most)))[:most]


def _int(rng: random.Random) -> int:
    return rng.choice([*_INT32, 0, 1, -1, rng.randint(*_INT32)])


def _float(rng: random.Random) -> float:
    return rng.choice([*_FLOATS, rng.uniform(-1e6, 1e6)])


def _when(rng: random.Random) -> datetime:
    """UTC or another offset, with microseconds (the column type refuses naive ones): each path must hand
    the driver the same value."""
    when = datetime(2000, 1, 1) + timedelta(seconds=rng.randint(0, 2**30), microseconds=rng.randint(0, 999_999))
    zone = rng.choice([UTC, timezone(timedelta(hours=rng.randint(-12, 14), minutes=rng.choice([0, 30])))])
    return when.replace(tzinfo=zone)


def _json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randint(0, 7 if depth < 3 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        # Beyond 64 bits the store's serializer falls back to the stdlib (store/db.py).
        return rng.choice([_int(rng), 2**64 + rng.randint(0, 9), -(2**70)])
    if kind == 3:
        return rng.choice([0.5, -1e-7, 1e300, rng.uniform(-1, 1)])
    if kind == 4:
        return _text(rng)
    if kind == 5:
        return [_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_text(rng, 12): _json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _maybe(rng: random.Random, value: Any) -> Any:
    return None if rng.random() < 0.3 else value


def _session_row(rng: random.Random, sid: str) -> dict[str, Any]:
    """Every column of `sessions`, random, None where the column allows it."""
    return {
        "id": sid, "group_id": _text(rng), "status": _text(rng, 16), "owner": _maybe(rng, _text(rng, 64)),
        "created_at": _when(rng), "updated_at": _when(rng), "model": _maybe(rng, _text(rng)),
        # Counts the touches add to: near the top of int32, not at it.
        "calls": rng.choice([_INT32[0], 2**31 - 2**16, rng.randint(0, 2**30)]), "tokens": rng.randint(0, 2**30),
        "reward": _maybe(rng, _float(rng)),
        "reward_override": _maybe(rng, _float(rng)), "excluded": rng.choice([True, False]),
        "lease_owner": _maybe(rng, _text(rng, 64)), "lease_until": _maybe(rng, _when(rng)),
        "policy_version": _maybe(rng, _int(rng)), "trained_version": _maybe(rng, _int(rng)),
        "skip_reason": _maybe(rng, _text(rng, 32)), "policy": _text(rng, 64),
        # A JSON column's None is JSON null on both paths (the type's none_as_null is off).
        "redactions": _maybe(rng, {_text(rng, 8): _int(rng) for _ in range(rng.randint(0, 3))}),
        "purged": _maybe(rng, rng.choice(["retention", "deleted"])), "purged_at": _maybe(rng, _when(rng)),
    }


def _call_row(rng: random.Random, cid: str, sid: str, parents: list[str]) -> dict[str, Any]:
    """Every column of `calls`, random; token arrays as the store encodes them, extremes included."""
    ids = [rng.choice([*_INT32, rng.randint(0, 50_000)]) for _ in range(rng.randint(0, 20))]
    logprobs = [rng.choice([0.0, -1e-30, -50.0, rng.uniform(-20, 0)]) for _ in range(rng.randint(0, 20))]
    return {
        "id": cid, "completion_id": _text(rng), "choice_index": _int(rng), "session_id": sid,
        "group_id": _text(rng), "seq": _int(rng), "parent_id": _maybe(rng, rng.choice([*parents, _text(rng)])),
        "link": rng.choice(["start", "extend", "branch", "prefix_changed", _text(rng, 32)]), "model": _text(rng),
        "policy_version": _int(rng), "finish_reason": _maybe(rng, _text(rng, 32)), "prefix_len": _int(rng),
        "prompt_tokens": _int(rng), "completion_tokens": _int(rng), "latency_ms": _float(rng),
        "created_at": _when(rng), "owner": _maybe(rng, _text(rng, 64)), "state_hash": _text(rng, 64),
        "prompt_ids": encode_ids(ids), "completion_ids": encode_ids(ids[::-1]),
        "completion_logprobs": encode_floats(logprobs),
        "messages": [{"role": rng.choice(["user", "assistant", "tool"]), "content": _json(rng)}
                     for _ in range(rng.randint(0, 4))],
        "messages_inherited": _int(rng), "response_message": {"role": "assistant", "content": _text(rng)},
        "request_params": {_text(rng, 10): _json(rng) for _ in range(rng.randint(0, 4))},
        "redactions": _maybe(rng, _json(rng)),
    }


def _run(conn: Connection, kind: str, prepared: Prepared, params: Any, fast: bool) -> Any:
    """Run one op through `prepared` (the shortcut) or through Core on the same statement (the reference).
    A read gives its rows; a single-row write its row count (add_session_if_absent reads it); an
    executemany gives None (its row count is the driver's business, and the store never reads it)."""
    # Core keeps an INSERT's row count only when asked to (PostgreSQL's driver forgets it otherwise).
    result = prepared.execute(conn, params) if fast else \
        conn.execute(cast(Executable, prepared.statement), params, execution_options={"preserve_rowcount": True})
    if kind == "read":
        return [tuple(row) for row in result.fetchall()]
    return int(result.rowcount) if isinstance(params, dict) else None


def _stored(db: Engine, table: Table) -> list[tuple[Any, ...]]:
    """A table's rows as the driver returns them, unconverted (JSON columns as their stored text), by key."""
    columns = ", ".join(f"CAST({c.name} AS TEXT)" if isinstance(c.type, JSON) else c.name for c in table.columns)
    key = ", ".join(c.name for c in table.primary_key.columns)
    with db.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT {columns} FROM {table.name} ORDER BY {key}").fetchall()
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in rows]


def test_prepared_statements_write_and_read_what_core_does(two_stores: tuple[Engine, Engine]) -> None:
    """Fences the prepared statements of store/queries.py (compiled once, run on the driver's cursor) with
    the plain reference: the same `Prepared.statement` through `Connection.execute`. Random sessions and
    calls (unicode, None, int32 extremes, floats and infinities, encoded ids, nested JSON with big ints,
    datetimes in several zones) and random touches, each written through both paths into its own store,
    leave identical rows; every read statement gives identical results and row counts on both paths."""
    fast_store, plain_store = two_stores
    dialect = fast_store.dialect.name
    insert_session = queries._INSERT_SESSION["postgresql" if dialect == "postgresql" else "sqlite"]
    rng = random.Random(30)
    for store in two_stores:  # policies for the promotion read, written the same way into both
        with Session(store) as db:
            for version in range(1, 6):
                db.add(Policy(version=version, promotion=_POLICY_STATES[version % len(_POLICY_STATES)]))
            db.commit()
    found = skipped = 0
    sids: list[str] = []
    cids: list[str] = []
    for round_ in range(ROUNDS):
        # One round's random operations, then the same operations on both paths, each in one transaction.
        ops: list[tuple[str, Prepared, Any]] = []
        for _ in range(rng.randint(1, 4)):
            sid = rng.choice(sids) if sids and rng.random() < 0.25 else f"s{len(sids)}{_text(rng, 30)}"
            ops.append(("write", insert_session, _session_row(rng, sid)))  # a repeat: ON CONFLICT DO NOTHING
            if sid not in sids:
                sids.append(sid)
        for _ in range(rng.randint(0, 3)):
            touch = {"sid": rng.choice([*sids, "absent"]), "now": _when(rng), "n": rng.randint(0, 9),
                     "t": rng.randint(0, 10_000)}
            ops.append(("write", queries._TOUCH_SESSION, touch))
        calls = []
        for _ in range(rng.randint(1, 5)):
            cids.append(f"c{len(cids)}{_text(rng, 20)}")
            calls.append(_call_row(rng, cids[-1], rng.choice(sids), cids[:-1]))
        ops.append(("write", queries._INSERT_CALLS, calls))
        for _ in range(4):
            sid = rng.choice([*sids, "absent"])
            ops.append(("read", queries._NEXT_SEQ, {"sid": sid}))
            ops.append(("read", queries._SESSION_OWNER, {"sid": sid}))
            ops.append(("read", queries._CHAINED_CHILD, {"sid": sid, "parent": rng.choice([*cids, "absent"])}))
            line = rng.choice(["default", "support"])
            ops.append(("read", queries._PROMOTION_LOCKED, {"v": rng.randint(-1, 7), "line": line}))
        outcomes = []
        for store, fast in ((fast_store, True), (plain_store, False)):
            with store.begin() as conn:
                outcomes.append([_run(conn, kind, prepared, params, fast) for kind, prepared, params in ops])
        assert outcomes[0] == outcomes[1], f"round {round_}"
        for table in (_SESSIONS, _CALLS):
            assert _stored(fast_store, table) == _stored(plain_store, table), f"{table.name}, round {round_}"
        found += sum(1 for (kind, _, _), out in zip(ops, outcomes[0], strict=True)
                     if kind == "read" and out and out[0][0] is not None)
        skipped += outcomes[0].count(0)
    # The random rounds reached both sides of each branch: reads that found rows, writes that changed none.
    assert found > ROUNDS and skipped > 0
