"""The store writer's commits on the event loop (store/writer.py) against its commits in a thread."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Table
from sqlalchemy.engine import Engine
from sqlmodel import Session, func, select

from tracetrain.store import queries
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Call, Reward
from tracetrain.store.writer import StoreWriter, WriteOp

OPS = 300
"""Random write ops per run, submitted to each writer."""

_NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def _call_row(cid: str, parent: str | None, rng: random.Random) -> dict[str, Any]:
    ids = [rng.randint(0, 50_000) for _ in range(rng.randint(1, 8))]
    return {"id": cid, "completion_id": f"cc-{cid}", "choice_index": 0, "session_id": "", "group_id": "g",
            "parent_id": parent, "link": rng.choice(["start", "extend", "branch"]), "model": "m", "policy_version": 0,
            "finish_reason": "stop", "prefix_len": 0, "prompt_tokens": len(ids), "completion_tokens": 2,
            "latency_ms": 1.5, "created_at": _NOW, "owner": None, "state_hash": f"h-{cid}",
            "prompt_ids": encode_ids(ids), "completion_ids": encode_ids([7, 8]),
            "completion_logprobs": encode_floats([-0.5, -1.0]), "messages": [{"role": "user", "content": f"q {cid} ✓"}],
            "messages_inherited": 0,
            "response_message": {"role": "assistant", "content": "a"}, "request_params": {}}


def _random_ops(rng: random.Random) -> list[WriteOp]:
    """Serving writes, rewards, reads and ops that fail: a call id used twice (primary key), a call of a
    session never created (foreign key), a reward's idempotency key used twice (unique), an op that raises
    after adding a row. Failures poison their batch, so the writer retries its ops one by one."""
    sids = [f"s{i}-é" for i in range(6)]
    ops: list[WriteOp] = []
    cids: list[str] = []
    for n in range(OPS):
        kind = rng.choices(["record", "reward", "read", "raise"], weights=[12, 6, 4, 0.5])[0]
        sid = rng.choice(sids)
        if kind == "record":
            # Now and then a call id again, or a session never created and not created by this call.
            cid = rng.choice(cids) if cids and rng.random() < 0.03 else f"c{n}"
            cids.append(cid)
            absent = rng.random() < 0.03
            rows = [{**_call_row(cid, rng.choice([None, *cids[-5:]]), rng), "session_id": "absent" if absent else sid}]
            new = None if absent or rng.random() < 0.15 else {"id": sid, "group_id": "g", "owner": None,
                                                             "policy_version": rng.choice([None, 0])}
            found = rng.choice([None, {"EMAIL": rng.randint(1, 3)}])
            ops.append(lambda db, s=rows[0]["session_id"], new=new, rows=rows, found=found: queries.record_calls(
                db, session_id=s, new_session=new, rows=rows, redactions=found))
        elif kind == "reward":
            reward = {"session_id": sid, "value": rng.uniform(-1, 1), "final": rng.random() < 0.1,
                      "idempotency_key": rng.choice([None, *(f"k{i}" for i in range(100))]), "created_at": _NOW}
            ops.append(lambda db, r=reward: queries.add_reward(db, reward=Reward(**r)))
        elif kind == "read":
            ops.append(lambda db: (db.exec(select(func.count()).select_from(Call)).one(),
                                   db.exec(select(func.sum(AgentSession.reward))).one()))
        else:
            def refuse(db: Session, n: int = n) -> None:
                db.add(AgentSession(id=f"refused-{n}", group_id="g", created_at=_NOW, updated_at=_NOW))
                raise ValueError(f"op {n} refused")
            ops.append(refuse)
    return ops


async def _submit_all(writer: StoreWriter, ops: list[WriteOp], rng: random.Random) -> list[Any]:
    """Submit `ops` in order, letting the loop run now and then so batches of every size form."""
    pending: list[asyncio.Task[Any]] = []
    for op in ops:
        pending.append(asyncio.create_task(writer.submit(op)))
        if rng.random() < 0.3:
            await asyncio.sleep(0)
        if rng.random() < 0.05:
            await asyncio.gather(*pending, return_exceptions=True)
    return list(await asyncio.gather(*pending, return_exceptions=True))


def _outcome(result: Any) -> Any:
    """An op's result, or its exception as type and message (the message names the statement and values)."""
    return (type(result).__name__, str(result)) if isinstance(result, BaseException) else result


def _stored(db: Engine) -> dict[str, list[tuple[Any, ...]]]:
    tables: list[Table] = [AgentSession.__table__, Call.__table__, Reward.__table__]  # type: ignore[attr-defined]
    with db.connect() as conn:
        return {t.name: conn.exec_driver_sql(f"SELECT * FROM {t.name} ORDER BY 1").fetchall() for t in tables}


async def _run(db: Engine, inline: Callable[[], bool], seed: int) -> tuple[list[Any], StoreWriter]:
    writer = StoreWriter(db, max_batch=16, inline=inline)
    await writer.start()
    try:
        results = await _submit_all(writer, _random_ops(random.Random(seed)), random.Random(seed + 1))
    finally:
        await writer.stop()
    return [_outcome(r) for r in results], writer


async def test_commits_on_the_loop_end_as_commits_in_the_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Fences the writer's commit on the event loop (`inline` true: the gateway idle) with the reference, the
    same writer committing in its worker thread (`inline` false). The same random sequence of serving
    writes, rewards, reads and failing ops, submitted to each on a fresh SQLite store (`inline` applies to
    SQLite only), gives every op the same result or exception and leaves the same rows."""
    monkeypatch.setattr(queries, "utcnow", lambda: _NOW)  # the writes' own timestamps, equal in both stores
    caplog.set_level(logging.DEBUG, logger="tracetrain.store.writer")
    runs = []
    for name, inline in (("loop", lambda: True), ("thread", lambda: False)):
        caplog.clear()
        db = open_db(f"sqlite:///{tmp_path / f'{name}.db'}")
        results, writer = await _run(db, inline, seed=30)
        retried = [int(n) for n in re.findall(r"group commit of (\d+) ops failed", caplog.text)]
        runs.append((results, _stored(db), writer, retried))
        db.dispose()
    (loop_results, loop_rows, loop_writer, loop_retried), (results, rows, writer, retried) = runs
    for i, (got, want) in enumerate(zip(loop_results, results, strict=True)):
        assert got == want, f"op {i}"
    assert loop_rows == rows
    # The run took the paths it fences: batches on the loop (and none there for the reference), failed
    # batches of several ops retried one by one, and ops that failed as well as ops that did not.
    assert loop_writer.inline_batches > 0 and writer.inline_batches == 0
    assert any(n > 1 for n in loop_retried) and any(n > 1 for n in retried)
    failed = [r for r in results if isinstance(r, tuple) and r and r[0] in ("IntegrityError", "ValueError")]
    assert {r[0] for r in failed} == {"IntegrityError", "ValueError"} and len(failed) < len(results) // 2
