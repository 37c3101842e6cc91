"""The store on real SQLite and PostgreSQL: group commit, failure isolation, compact token arrays."""

from __future__ import annotations

import asyncio
import fcntl
import sqlite3
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlmodel import Session, select

from tracetrain.store import promotion
from tracetrain.store.codec import decode_floats, decode_ids, encode_floats, encode_ids
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Call, Policy, Reward, utcnow
from tracetrain.store.queries import CALL_COLUMNS, record_calls
from tracetrain.store.writer import StoreWriter


def _call(i: int, session_id: str = "s") -> Call:
    return Call(
        id=f"c{i}", completion_id=f"chatcmpl-{i}", session_id=session_id, group_id="g", seq=i, link="start",
        model="m", state_hash=f"h{i}", prompt_ids=encode_ids([1, 2, i]), completion_ids=encode_ids([i, 7]),
        completion_logprobs=encode_floats([-0.5, -1.25]), messages=[{"role": "user", "content": "x"}],
        response_message={"role": "assistant", "content": "y"},
    )


async def test_group_commit_stores_every_call_and_batches(db_url: str) -> None:
    db = open_db(db_url)
    writer = StoreWriter(db)
    await writer.start()
    await writer.submit(lambda s: s.add(AgentSession(id="s", group_id="g")))
    await asyncio.gather(*(writer.submit(lambda s, i=i: s.add(_call(i))) for i in range(200)))
    await writer.stop()
    with Session(db) as s:
        calls = s.exec(select(Call)).all()
    assert len(calls) == 200
    assert writer.batches < 100, "concurrent submits should share transactions"
    stored = next(c for c in calls if c.id == "c5")
    assert decode_ids(stored.prompt_ids) == [1, 2, 5]
    assert decode_floats(stored.completion_logprobs) == [-0.5, -1.25]


async def test_a_failing_op_fails_alone(db_url: str) -> None:
    db = open_db(db_url)
    writer = StoreWriter(db)
    await writer.start()
    await writer.submit(lambda s: s.add(AgentSession(id="s", group_id="g")))
    await writer.submit(lambda s: s.add(Reward(session_id="s", value=1.0, idempotency_key="k")))
    results = await asyncio.gather(
        writer.submit(lambda s: s.add(_call(1))),
        writer.submit(lambda s: s.add(Reward(session_id="s", value=2.0, idempotency_key="k"))),
        writer.submit(lambda s: s.add(_call(2))),
        return_exceptions=True,
    )
    await writer.stop()
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], Exception)
    with Session(db) as s:
        assert {c.id for c in s.exec(select(Call)).all()} == {"c1", "c2"}
        assert [r.value for r in s.exec(select(Reward)).all()] == [1.0]


def test_token_arrays_are_stored_as_bytes(db_url: str) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        s.add(AgentSession(id="s", group_id="g"))
        s.add(_call(3))
        s.commit()
        raw = s.execute(text("SELECT prompt_ids FROM calls")).scalar_one()
    assert bytes(raw) == encode_ids([1, 2, 3])
    assert len(bytes(raw)) == 12


def test_sqlite_runs_in_wal_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    with db.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"


def test_codec_round_trip_keeps_extremes() -> None:
    ids = [0, 1, 2**31 - 1, 151_643]
    assert decode_ids(encode_ids(ids)) == ids
    assert decode_ids(None) == []
    values = decode_floats(encode_floats([-1e-8, -30.0]))
    assert values[1] == -30.0 and values[0] == pytest.approx(-1e-8)


async def test_sqlite_writers_take_turns_through_the_lock_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Another gateway process holding the lock file (here: another open file, which `flock` treats
    alike) keeps this writer's commit waiting; it commits as soon as the lock is let go."""
    path = tmp_path / "store.db"
    db = open_db(f"sqlite:///{path}")
    writer = StoreWriter(db)
    await writer.start()
    await writer.submit(lambda s: s.add(AgentSession(id="s", group_id="g")))
    with open(f"{path}-writelock", "a+b") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        pending = asyncio.ensure_future(writer.submit(lambda s: s.add(_call(1))))
        await asyncio.sleep(0.5)
        assert not pending.done()
        fcntl.flock(other, fcntl.LOCK_UN)
        await asyncio.wait_for(pending, timeout=5)
    await writer.stop()
    with Session(db) as s:
        assert [c.id for c in s.exec(select(Call)).all()] == ["c1"]


def _thread_of_op(writer: StoreWriter, i: int) -> Any:
    """Submit an op that stores a call and says which thread ran it."""
    def op(db: Session) -> str:
        db.add(_call(i))
        return threading.current_thread().name
    return writer.submit(op)


async def test_a_batch_alone_on_the_loop_commits_there_and_otherwise_in_the_thread(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    alone = True
    writer = StoreWriter(db, inline=lambda: alone)
    await writer.start()
    await writer.submit(lambda s: s.add(AgentSession(id="s", group_id="g")))
    assert await _thread_of_op(writer, 1) == threading.current_thread().name
    alone = False
    assert await _thread_of_op(writer, 2) != threading.current_thread().name
    await writer.stop()
    assert writer.inline_batches == 2
    with Session(db) as s:
        assert [c.id for c in s.exec(select(Call)).all()] == ["c1", "c2"]


async def _ticks_while_pending(pending: asyncio.Future[Any], seconds: float) -> int:
    """Event-loop turns of 10 ms during `seconds` while `pending` stays pending (the loop is not blocked)."""
    ticks = 0
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
        ticks += 1
    assert not pending.done()
    return ticks


async def test_a_batch_that_would_wait_for_a_lock_goes_to_the_thread(tmp_path: Path) -> None:
    """Another process holding the lock file, or SQLite's write lock (a trainer, which takes no lock file),
    never blocks the event loop: the batch waits in the writer's thread and commits once the lock is free."""
    path = tmp_path / "store.db"
    db = open_db(f"sqlite:///{path}")
    writer = StoreWriter(db, inline=lambda: True)
    await writer.start()
    await writer.submit(lambda s: s.add(AgentSession(id="s", group_id="g")))
    with open(f"{path}-writelock", "a+b") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        pending = asyncio.ensure_future(_thread_of_op(writer, 1))
        assert await _ticks_while_pending(pending, 0.5) >= 20
        fcntl.flock(other, fcntl.LOCK_UN)
        assert await asyncio.wait_for(pending, timeout=5) != threading.current_thread().name
    trainer = sqlite3.connect(path, isolation_level=None)
    trainer.execute("BEGIN IMMEDIATE")
    pending = asyncio.ensure_future(_thread_of_op(writer, 2))
    assert await _ticks_while_pending(pending, 0.5) >= 20
    trainer.execute("COMMIT")
    trainer.close()
    assert await asyncio.wait_for(pending, timeout=35) != threading.current_thread().name
    assert await _thread_of_op(writer, 3) == threading.current_thread().name  # nothing held: on the loop again
    await writer.stop()
    with db.connect() as conn:  # the writer's connection waits for SQLite's lock as before
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30000
    with Session(db) as s:
        assert [c.id for c in s.exec(select(Call)).all()] == ["c1", "c2", "c3"]


async def test_a_session_recorded_after_its_canary_was_rolled_back_is_set_aside(db_url: str) -> None:
    """A call routed to a canary just before its rollback may be recorded just after it, past the
    rollback's own setting aside: the write sees the rollback and sets its new session aside itself."""
    db = open_db(db_url)
    with Session(db) as s:
        promotion.mark_published(s, version=1, checkpoint=Path("/v1"), kind="lora", promotion="canary")
    writer = StoreWriter(db)
    await writer.start()

    def record(session_id: str, check: bool) -> Any:
        row = {name: value for name, value in _call(0, session_id).model_dump().items() if name in CALL_COLUMNS}
        row.update(id=f"c-{session_id}", completion_id=f"cc-{session_id}", policy_version=1, prompt_tokens=3,
                   prefix_len=0, completion_tokens=2)
        new = {"id": session_id, "group_id": session_id, "owner": None, "policy_version": 1}
        return writer.submit(lambda s: record_calls(s, session_id=session_id, new_session=new, rows=[row],
                                                    check_rollback=check))

    await record("before", True)
    with Session(db) as s:
        assert promotion.decide(s, version=1, outcome=promotion.ROLLED_BACK, decision={"by": "test"})
    await record("after", True)
    await record("unchecked", False)  # immediate promotion: no check, as before
    await writer.stop()
    with Session(db) as s:
        reasons = {row.id: row.skip_reason for row in s.exec(select(AgentSession)).all()}
    assert reasons == {"before": "rolled_back", "after": "rolled_back", "unchecked": None}


@pytest.mark.parametrize("call_first", [True, False])
def test_a_version_is_dated_served_no_later_than_its_first_call(db_url: str, call_first: bool) -> None:
    """A call on a new version can be recorded before the gateway writes the hand-over's date, and the
    trainer writes its own date later still: published_at must stay the earliest, never after the first call."""
    db = open_db(db_url)
    handed_over = utcnow()
    first_call = handed_over - timedelta(milliseconds=17) if call_first else handed_over + timedelta(seconds=1)
    with Session(db) as s:
        s.add(Policy(version=1, checkpoint="/v1", kind="lora"))
        s.commit()
        if call_first:
            promotion.record_first_call(s, version=1, at=first_call)
            s.commit()
        promotion.mark_published(s, version=1, checkpoint=Path("/v1"), kind="lora", promotion="immediate",
                                 at=handed_over)
        if not call_first:
            promotion.record_first_call(s, version=1, at=first_call)
            s.commit()
        promotion.record_publish(s, line="default", version=1, error=None, seconds=0.5)  # the trainer, later
    with Session(db) as s:
        policy = s.get(Policy, ("default", 1))
        assert policy is not None and policy.published_at is not None and policy.first_call_at is not None
        assert policy.published_at <= policy.first_call_at
        expected = first_call if call_first else handed_over
        assert policy.published_at.replace(tzinfo=None) == expected.replace(tzinfo=None)
