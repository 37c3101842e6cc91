"""What the trainer feeds on, against a real store (SQLite and PostgreSQL): whole groups, freshest
first; stale and zero-variance sessions set aside, never consumed; full batches, waited for within a bound."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, select

from tracetrain.config import TrainConfig
from tracetrain.store import leases
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Call, Reward, utcnow
from tracetrain.trainer.batch import BatchGatherer


def _add(db: Session, sid: str, group: str, reward: float | None, *, version: int = 0, age_s: float = 0.0) -> None:
    """A one-call session sampled by `version`, final `age_s` ago (reward None: still open)."""
    at = utcnow() - timedelta(seconds=age_s)
    db.add(AgentSession(id=sid, group_id=group, status="open" if reward is None else "final", updated_at=at))
    db.add(Call(id=f"{sid}-c", completion_id=f"chatcmpl-{sid}", session_id=sid, group_id=group, link="start",
                model="tiny", policy_version=version, state_hash=sid, prompt_ids=encode_ids([1, 2, 3]),
                completion_ids=encode_ids([4, 5]), completion_logprobs=encode_floats([-1.0, -1.0]),
                messages=[], response_message={}))
    if reward is not None:
        db.add(Reward(session_id=sid, value=reward, final=True))


def _rows(db: object) -> dict[str, tuple[int | None, str | None]]:
    with Session(db) as s:  # type: ignore[call-overload]
        return {row.id: (row.trained_version, row.skip_reason) for row in s.exec(select(AgentSession)).all()}


def test_claims_take_whole_groups_freshest_first(db_url: str) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        for i in range(2):
            _add(s, f"old-{i}", "g-old", float(i), version=1, age_s=50)
            _add(s, f"new-{i}", "g-new", float(i), version=3, age_s=40)
            _add(s, f"mid-{i}", "g-mid", float(i), version=2, age_s=1)  # finished last, sampled earlier
        s.commit()
        assert (leases.ready_count(s), leases.leased_count(s)) == (6, 0)
        assert sorted(leases.claim_groups(s, trainer_id="t", want=4, lease_s=60, min_version=None,
                                          settle_s=30)) == ["mid-0", "mid-1", "new-0", "new-1"]
        assert (leases.ready_count(s), leases.leased_count(s)) == (2, 4)  # claimed for a step in progress
        # the staleness floor keeps older samples out of a claim altogether
        assert leases.claim_groups(s, trainer_id="t", want=4, lease_s=60, min_version=2, settle_s=30) == []
        assert sorted(leases.claim_groups(s, trainer_id="t", want=4, lease_s=60, min_version=1,
                                          settle_s=30)) == ["old-0", "old-1"]


def test_a_group_with_a_running_member_waits_until_it_settles(db_url: str) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        _add(s, "a-0", "g-a", 1.0, age_s=5)
        _add(s, "a-1", "g-a", None, age_s=5)  # still running, active 5 s ago
        _add(s, "b-0", "g-b", 1.0, age_s=120)
        _add(s, "b-1", "g-b", None, age_s=120)  # abandoned 2 minutes ago
        s.commit()
        claim = dict(trainer_id="t", want=8, lease_s=60, min_version=None)
        assert leases.claim_groups(s, **claim, settle_s=30) == ["b-0"]  # type: ignore[arg-type]
        # once the first finished member is older than the settle time, a busy group is taken anyway
        assert leases.claim_groups(s, **claim, settle_s=2) == ["a-0"]  # type: ignore[arg-type]


def _gatherer(db_url: str, tmp_path: Path, **overrides: object) -> BatchGatherer:
    cfg = TrainConfig(**{"batch_sessions": 4, "min_sessions": 2, "max_staleness": 1, "fill_timeout_s": 1.5,
                         "poll_s": 0.05, "group_settle_s": 30, "checkpoint_dir": tmp_path, **overrides})  # type: ignore[arg-type]
    return BatchGatherer(cfg, open_db(db_url), "trainer-test")


def test_unusable_sessions_are_set_aside_not_consumed_and_replaced(db_url: str, tmp_path: Path) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        _add(s, "stale-0", "g-stale", 0.0, version=1, age_s=1)
        _add(s, "stale-1", "g-stale", 1.0, version=1, age_s=1)
        _add(s, "flat-0", "g-flat", 1.0, version=3, age_s=1)  # freshest, but every member scored the same
        _add(s, "flat-1", "g-flat", 1.0, version=3, age_s=1)
        for g in ("x", "y"):
            _add(s, f"{g}-0", f"g-{g}", 0.0, version=2, age_s=10)
            _add(s, f"{g}-1", f"g-{g}", 1.0, version=2, age_s=10)
        s.commit()
    # trainer at version 3, max staleness 1: version 1 is stale
    batch = _gatherer(db_url, tmp_path, flat_groups="set_aside").gather(3)
    assert batch is not None
    assert sorted(batch.session_ids) == ["x-0", "x-1", "y-0", "y-1"]  # the flat group was replaced
    assert dict(batch.set_aside) == {"stale": 2, "zero_variance": 2}
    assert batch.figures(3)["staleness"] == {"1": 4}
    rows = _rows(db)
    assert {k: v for k, v in rows.items() if v[1]} == {
        "stale-0": (None, "stale"), "stale-1": (None, "stale"),
        "flat-0": (None, "zero_variance"), "flat-1": (None, "zero_variance")}
    with Session(db) as s:
        assert leases.set_aside_counts(s) == {"stale": 2, "zero_variance": 2}
        # what the online trainer left is still there for offline algorithms
        assert sorted(leases.claim_groups(s, trainer_id="sft", want=8, lease_s=60, min_version=None, settle_s=30,
                                          include_set_aside=True)) == ["flat-0", "flat-1", "stale-0", "stale-1"]


@pytest.mark.parametrize("flat_groups", ["baseline", "keep"])
def test_flat_groups_stay_in_the_batch_unless_set_aside(db_url: str, tmp_path: Path, flat_groups: str) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        _add(s, "flat-0", "g-flat", 0.0, version=3, age_s=1)
        _add(s, "flat-1", "g-flat", 0.0, version=3, age_s=1)
        _add(s, "x-0", "g-x", 0.0, version=3, age_s=10)
        _add(s, "x-1", "g-x", 1.0, version=3, age_s=10)
        s.commit()
    batch = _gatherer(db_url, tmp_path, flat_groups=flat_groups).gather(3)
    assert batch is not None
    assert sorted(batch.session_ids) == ["flat-0", "flat-1", "x-0", "x-1"]
    assert sum(batch.set_aside.values()) == 0


def test_a_step_waits_for_a_full_batch_within_a_bound(db_url: str, tmp_path: Path) -> None:
    db = open_db(db_url)
    gatherer = _gatherer(db_url, tmp_path)
    stop = threading.Event()
    result: list[object] = []
    with Session(db) as s:
        _add(s, "a-0", "g-a", 0.0)  # one session: fewer than min_sessions
        s.commit()
    thread = threading.Thread(target=lambda: result.append(gatherer.gather(0, stop)))
    began = time.monotonic()
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "a step does not train on fewer than min_sessions"
    with Session(db) as s:
        _add(s, "a-1", "g-a", 1.0)  # the group now has 2 of the 4 wanted: min_sessions reached
        s.commit()
    thread.join(timeout=10)
    waited = time.monotonic() - began
    (batch,) = result
    assert batch is not None and len(batch.session_ids) == 2  # type: ignore[attr-defined]
    assert waited >= 1.0 + 1.5 - 0.2, "with min_sessions it still waited fill_timeout_s for a full batch"

    # a full batch goes at once; and a stopped wait hands its claims back
    with Session(db) as s:
        for i in range(4):
            _add(s, f"b-{i}", "g-b", float(i % 2))
        _add(s, "c-0", "g-c", 1.0, age_s=5)
        s.commit()
    began = time.monotonic()
    full = gatherer.gather(0, stop)
    assert full is not None and len(full.session_ids) == 4 and time.monotonic() - began < 1.0
    stop.set()
    assert gatherer.gather(0, stop) is None
    with Session(db) as s:
        assert leases.ready_count(s) == 1, "c-0 was claimed, then released when the wait stopped"
