"""Upgrades keep the data: a store made by tracetrain 0.1 (its schema checked in as tests/data) is refused
with what to run, migrated by `tracetrain db upgrade`, and then read and trained on; new stores start
at the newest revision on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import inspect
from sqlmodel import Session, select

from tracetrain.config import TrainConfig
from tracetrain.store import audit, leases, policy_lines, queries, schema
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import connect_db, open_db
from tracetrain.store.messages import call_messages
from tracetrain.store.models import AgentSession, Policy, utcnow
from tracetrain.store.trajectory import session_trajectories
from tracetrain.trainer.loop import Trainer

SCHEMA_0_1 = Path(__file__).resolve().parents[1] / "data" / "store_schema_0_1.sql"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracetrain.cli", *args], capture_output=True, text=True, timeout=300)


def _store_0_1(path: Path) -> str:
    """A 0.1 store with one group of two finished one-call sessions, rows written as 0.1 wrote them
    (plain SQL: today's models have columns the 0.1 tables lack)."""
    now = "2026-01-01 00:00:00.000000"
    with sqlite3.connect(path) as connection:
        connection.executescript(SCHEMA_0_1.read_text())
        connection.execute("INSERT INTO policies (version, created_at, kind, metrics) VALUES (0, ?, 'base', '{}')",
                           (now,))
        for i, reward in enumerate((0.0, 1.0)):
            sid = f"old-{i}"
            connection.execute("INSERT INTO sessions (id, group_id, status, created_at, updated_at) "
                               "VALUES (?, 'g', 'final', ?, ?)", (sid, now, now))
            connection.execute(
                "INSERT INTO calls (id, completion_id, choice_index, session_id, group_id, seq, link, model, "
                "policy_version, prefix_len, prompt_tokens, completion_tokens, latency_ms, created_at, state_hash, "
                "prompt_ids, completion_ids, completion_logprobs, messages, response_message, request_params) "
                "VALUES (?, ?, 0, ?, 'g', 0, 'start', 'tiny', 0, 0, 5, 3, 0.0, ?, ?, ?, ?, ?, ?, ?, '{}')",
                (f"{sid}-c", f"chatcmpl-{sid}", sid, now, sid, encode_ids([1, 4093, 198, 6004, 2]),
                 encode_ids([28, 29 + i, 2]), encode_floats([-10.8] * 3),
                 json.dumps([{"role": "user", "content": "hi"}]), json.dumps({"role": "assistant"})))
            connection.execute("INSERT INTO rewards (session_id, value, final, created_at) VALUES (?, ?, 1, ?)",
                               (sid, reward, now))
    return f"sqlite:///{path}"


def test_a_0_1_store_is_refused_then_upgraded_read_and_trained_on(tiny_model_path: Path, tmp_path: Path) -> None:
    url = _store_0_1(tmp_path / "old.db")
    with pytest.raises(schema.StoreOutOfDate, match="tracetrain db upgrade"):
        open_db(url)
    refused = _cli("train", "--db-url", url)
    assert refused.returncode != 0 and "tracetrain db upgrade" in refused.stderr and "Traceback" not in refused.stderr
    assert "tracetrain 0.1 (no revision)" in _cli("db", "current", "--db-url", url).stdout

    upgraded = _cli("db", "upgrade", "--db-url", url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"-> {schema.head()}" in upgraded.stdout
    assert schema.revision(connect_db(url)) == (schema.head(), True)

    db = open_db(url)
    with Session(db) as s:
        (trajectory,) = session_trajectories(queries.session_calls(s, session_id="old-1"))
        (old_call,) = queries.session_calls(s, session_id="old-0")
        assert call_messages(s, call=old_call) == [{"role": "user", "content": "hi"}], "0.1 rows keep all messages"
        # what the session list sorts and filters on is filled in for old sessions
        old = queries.get_session(s, session_id="old-1")
        assert old is not None
        assert (old.model, old.calls, old.tokens, old.reward, old.reward_override, old.excluded) == (
            "tiny", 1, 8, 1.0, None, False)
        assert old.redactions is None and old_call.redactions is None, "nothing was redacted before 0010"
    (segment,) = trajectory["segments"]
    assert segment["token_ids"] == [1, 4093, 198, 6004, 2, 28, 30, 2] and sum(segment["loss_mask"]) == 3
    cfg = TrainConfig(lora=False, lr=1e-3, batch_sessions=2, min_sessions=1, checkpoint_dir=tmp_path / "ckpt")
    trainer = Trainer(cfg, db, tiny_model_path)
    assert trainer.step_once() and trainer.version == 1
    assert _cli("db", "upgrade", "--db-url", url).returncode == 0, "upgrading again changes nothing"


def test_new_stores_start_at_the_newest_revision(db_url: str) -> None:
    open_db(db_url)
    assert schema.revision(connect_db(db_url)) == (schema.head(), True)
    open_db(db_url)  # and open again without complaint


def test_processes_opening_one_new_store_at_once_all_get_the_newest_revision(db_url: str) -> None:
    """`serve --workers N`, or several gateways started together on a new store: one creates the schema, the
    others wait for it instead of refusing a half-made store as tracetrain 0.1's or failing on a table that
    appeared meanwhile."""
    opener = ("import sys, time; from tracetrain.store.db import open_db; "
              "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); open_db(sys.argv[1]); print('ok')")
    start = time.time() + 4.0  # the interpreters are up by then; all open the store at that moment
    processes = [subprocess.Popen([sys.executable, "-c", opener, db_url, str(start)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in processes]
    for process, (out, err) in zip(processes, results, strict=True):
        assert process.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert schema.revision(connect_db(db_url)) == (schema.head(), True)
    with Session(open_db(db_url)) as s:
        assert [p.version for p in s.exec(select(Policy)).all()] == [0]


def test_0011_downgrades_to_0010_and_upgrades_again_keeping_the_sessions(db_url: str) -> None:
    """Retention's columns and the audit log come and go with 0011, on SQLite and PostgreSQL; the rest stays."""
    db = open_db(db_url)
    with Session(db) as s:
        s.add(AgentSession(id="s", group_id="g", purged="deleted", purged_at=utcnow()))
        audit.record(s, action="delete", actor=None, session_id="s", sessions=1)
        s.commit()
    with db.begin() as connection:
        command.downgrade(schema._config(connection), "0010")
    assert schema.revision(db) == ("0010", True)
    with db.connect() as connection:
        assert "audit_log" not in inspect(connection).get_table_names()
        assert {"purged", "purged_at"}.isdisjoint(c["name"] for c in inspect(connection).get_columns("sessions"))
        assert connection.exec_driver_sql("SELECT id, group_id FROM sessions").all() == [("s", "g")]
    schema.upgrade(db)
    with Session(db) as s:
        session = s.get(AgentSession, "s")
        assert session is not None and session.purged is None and session.purged_at is None
        assert audit.entries(s) == ([], 0)


def test_a_0011_store_upgrades_with_every_session_in_the_default_policy(db_url: str) -> None:
    """A store built at 0011, before named policies, holding sessions: 0012 puts each in the default policy and
    registers that policy; back down to 0011 and up again keeps the sessions."""
    db = connect_db(db_url)
    with db.begin() as connection:
        command.upgrade(schema._config(connection), "0011")
        for sid in ("old-a", "old-b"):
            connection.exec_driver_sql(
                "INSERT INTO sessions (id, group_id, status, created_at, updated_at, calls, tokens, excluded) "
                f"VALUES ('{sid}', 'g', 'final', '2026-01-01 00:00:00', '2026-01-01 00:00:00', 0, 0, false)")
    assert schema.revision(db) == ("0011", True)
    with pytest.raises(schema.StoreOutOfDate, match="tracetrain db upgrade"):
        open_db(db_url)
    assert schema.upgrade(db) == ("0011", schema.head())
    with Session(open_db(db_url)) as s:
        assert [(row.id, row.policy) for row in s.exec(select(AgentSession).order_by(AgentSession.id))] == [
            ("old-a", "default"), ("old-b", "default")]
        assert [(line.name, line.training, line.settings, line.source) for line in policy_lines.listed(s)] == [
            ("default", "lora", {}, "builtin")]
        assert policy_lines.create(s, name="default", training="lora", settings={}) is None, "the name is taken"
    with db.begin() as connection:
        command.downgrade(schema._config(connection), "0011")
    with db.connect() as connection:
        assert "policy_lines" not in inspect(connection).get_table_names()
        assert "policy" not in {c["name"] for c in inspect(connection).get_columns("sessions")}
        assert connection.exec_driver_sql("SELECT id FROM sessions ORDER BY id").all() == [("old-a",), ("old-b",)]
    schema.upgrade(db)
    with Session(db) as s:
        assert queries.all_session_ids(s, policy="default") == ["old-a", "old-b"]


def test_a_0012_store_upgrades_with_every_version_in_the_default_line(db_url: str) -> None:
    """A store built at 0012, before versions per named policy, holding versions: 0013 keys them by (line,
    version), each in the default line, so a named line can number its own from 0; back down to 0012 keeps the
    default line's and drops the others."""
    db = connect_db(db_url)
    with db.begin() as connection:
        command.upgrade(schema._config(connection), "0012")
        for version, kind in ((0, "base"), (1, "lora")):
            connection.exec_driver_sql(
                "INSERT INTO policies (version, created_at, kind, metrics, promotion) "
                f"VALUES ({version}, '2026-01-01 00:00:00', '{kind}', '{{}}', 'immediate')")
    with pytest.raises(schema.StoreOutOfDate, match="tracetrain db upgrade"):
        open_db(db_url)
    assert schema.upgrade(db) == ("0012", schema.head())
    with Session(open_db(db_url)) as s:
        assert [(p.line, p.version, p.kind) for p in queries.list_policies(s)] == [
            ("default", 0, "base"), ("default", 1, "lora")]
        latest = leases.latest_policy(s)
        assert latest is not None and latest.version == 1
        s.add(Policy(line="support", version=1, kind="lora"))  # the same number, another line
        s.commit()
        assert leases.latest_policy(s, line="support") is not None
    with db.connect() as connection:
        assert inspect(connection).get_pk_constraint("policies")["constrained_columns"] == ["line", "version"]
    with db.begin() as connection:
        command.downgrade(schema._config(connection), "0012")
    with db.connect() as connection:
        assert "line" not in {c["name"] for c in inspect(connection).get_columns("policies")}
        assert connection.exec_driver_sql("SELECT version FROM policies ORDER BY version").all() == [(0,), (1,)]
    schema.upgrade(db)
    with Session(db) as s:
        assert [(p.line, p.version) for p in queries.list_policies(s)] == [("default", 0), ("default", 1)]
