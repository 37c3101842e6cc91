"""Retention and erasure on SQLite and PostgreSQL: the gateway's scheduled purge and `tracetrain db purge` clear
the content of sessions past `store.retention_days` (a key may have its own) and keep their figures; a purge runs
beside live traffic without losing or failing anything; `DELETE /v1/sessions/{id}` erases one session; purged
sessions are never exported or claimed for training; no original text stays in a SQLite store's files; and
the audit log records every export, correction, no_train, purge and deletion."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import text, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.proxy.auth import fingerprint
from tracetrain.store import leases
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import connect_db, open_db
from tracetrain.store.models import PURGED_STATE, AgentSession, Call, Reward, utcnow

AGENT, KEEPER, ADMIN = "agent-key", "keeper-key", "admin-key"
"""KEEPER's sessions are kept forever (its own `retention_days: null`), whatever `store.retention_days` says."""


def _gateway(engine: TransformersEngine, model: Path, db_url: str, **store: Any) -> RunningGateway:
    return start_gateway(RecordingEngine(engine), model, db_url, store=store, gateway={
        "api_keys": [AGENT, {"key": KEEPER, "retention_days": None}], "admin_key": ADMIN})


@pytest.fixture
def retaining(tiny_engine: TransformersEngine, tiny_model_path: Path, db_url: str) -> Iterator[RunningGateway]:
    """A gateway that keeps content 30 days and purges every fraction of a second (sessions are aged by
    moving their `updated_at` back)."""
    running = _gateway(tiny_engine, tiny_model_path, db_url, retention_days=30, retention_interval_s=0.2)
    yield running
    running.stop()


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(gw: RunningGateway, session: str, text: str, key: str = AGENT,
          history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    messages = [*(history or []), {"role": "user", "content": text}]
    answer = httpx.post(f"{gw.v1(session)}/chat/completions", headers=_headers(key), timeout=60,
                        json={"model": "tiny", "max_tokens": 8, "messages": messages})
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def _finish(gw: RunningGateway, session: str, key: str = AGENT) -> None:
    done = httpx.post(f"{gw.url}/v1/rewards", headers=_headers(key),
                      json={"session_id": session, "reward": 1.0, "final": True})
    assert done.status_code == 200, done.text


def _admin(gw: RunningGateway, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{gw.url}{path}", headers=_headers(ADMIN), timeout=60, **kwargs)


def _age(db: Engine, session_ids: list[str], days: float, *, purged_days: float | None = None) -> None:
    """Move the sessions' last activity (and their last purge) `days` (`purged_days`) back."""
    moved: dict[str, Any] = {"updated_at": utcnow() - timedelta(days=days)}
    if purged_days is not None:
        moved["purged_at"] = utcnow() - timedelta(days=purged_days)
    with Session(db) as s:
        s.execute(update(AgentSession).where(col(AgentSession.id).in_(session_ids)).values(**moved))
        s.commit()


def _wait_for(check: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _purged(db: Engine, session_id: str) -> str | None:
    with Session(db) as s:
        session = s.get(AgentSession, session_id)
        assert session is not None
        return session.purged


def _assert_cleared(db: Engine, session_id: str) -> None:
    with Session(db) as s:
        for call in s.exec(select(Call).where(Call.session_id == session_id)).all():
            assert (call.messages, call.prompt_ids, call.completion_ids, call.completion_logprobs, call.state_hash,
                    call.request_params) == ([], b"", b"", b"", PURGED_STATE, {})
            assert call.response_message == {"role": "assistant", "content": None}


def _found_in_files(store: Path, texts: list[str]) -> list[tuple[str, str]]:
    """(text, file) for each text still in the SQLite store's files: the database, its WAL and its shared
    memory."""
    files = list(store.parent.glob(store.name + "*"))
    assert files
    return [(text, path.name) for path in files for text in texts if text.encode() in path.read_bytes()]


def _assert_not_in_files(store: Path, texts: list[str]) -> None:
    """For a purge or erasure that has returned (its WAL checkpoint included): nothing of it in the files."""
    assert not _found_in_files(store, texts)


def _assert_leaves_the_files(store: Path, texts: list[str]) -> None:
    """For the scheduled purge: the texts leave the files once its last step, the WAL checkpoint, has run. Its
    audit entry and cleared rows are committed before that, so the files are read until they are clean (or
    the wait times out)."""
    try:
        _wait_for(lambda: not _found_in_files(store, texts), timeout_s=30)
    except AssertionError:
        raise AssertionError(f"still in the store's files: {_found_in_files(store, texts)}") from None


def _sqlite_file(db_url: str) -> Path | None:
    return Path(db_url.removeprefix("sqlite:///")) if db_url.startswith("sqlite") else None


def test_the_scheduled_purge_clears_old_content_and_keeps_the_figures(retaining: RunningGateway, db_url: str) -> None:
    gw, db = retaining, retaining.gateway.db
    texts = {s: f"{s} remembers the lighthouse keeper's marmalade" for s in ("old", "kept-by-key", "recent")}
    texts["old"] += " qxzjvw"  # trigrams no other text has: the search index must lose them too
    replies = {}
    for session, key in (("old", AGENT), ("kept-by-key", KEEPER), ("recent", AGENT)):
        first = _chat(gw, session, texts[session], key)
        reply = first["choices"][0]["message"]
        _chat(gw, session, "and then?", key, history=[{"role": "user", "content": texts[session]}, reply])
        _finish(gw, session, key)
        replies[session] = reply["content"]
    before = _admin(gw, "GET", "/v1/sessions/old").json()
    store = _sqlite_file(db_url)
    if store is not None:  # indexed for the search before it is purged
        _wait_for(lambda: _indexed(db, "old") == 2)
    _age(db, ["old", "kept-by-key"], days=31)
    _wait_for(lambda: _purged(db, "old") is not None)

    after = _admin(gw, "GET", "/v1/sessions/old").json()
    assert after["purged"] == "retention" and after["purged_at"]
    figures = ("tokens", "reward", "status", "policy_version", "created_at", "model", "redactions")
    assert {k: after[k] for k in figures} == {k: before[k] for k in figures}
    assert [(c["id"], c["link"], c["prompt_tokens"], c["completion_tokens"]) for c in after["calls"]] == [
        (c["id"], c["link"], c["prompt_tokens"], c["completion_tokens"]) for c in before["calls"]]
    assert len(after["rewards"]) == 1 and after["reward_total"] == 1.0
    _assert_cleared(db, "old")
    assert _admin(gw, "GET", "/v1/sessions/old/trajectory").json()["trajectories"] == []
    assert _purged(db, "kept-by-key") is None and _purged(db, "recent") is None
    assert texts["recent"] in str(_admin(gw, "GET", "/v1/sessions/recent").json()["calls"])
    # The text search finds nothing of it any more, and the trainer and export never see it.
    assert _admin(gw, "GET", "/v1/sessions", params={"q": "old remembers"}).json()["total"] == 0
    assert _admin(gw, "GET", "/v1/sessions", params={"q": "recent remembers"}).json()["total"] == 1
    exported = _admin(gw, "GET", "/v1/export").text
    assert '"session_id":"old"' not in exported and '"session_id":"recent"' in exported
    with Session(db) as s:
        assert leases.ready_count(s) == 2  # recent and kept-by-key
    assert _admin(gw, "GET", "/v1/policies").json()["sessions"]["set_aside"] == {"purged": 1}
    (entry,) = _admin(gw, "GET", "/v1/audit", params={"action": "purge"}).json()["data"]
    assert (entry["actor"], entry["sessions"], entry["detail"]["calls"]) == ("retention", 1, 2)
    # A new call in the purged session starts afresh, and a later purge clears it once it is old too.
    _chat(gw, "old", "a brand new question about otters")
    assert _admin(gw, "GET", "/v1/sessions/old").json()["calls"][-1]["link"] not in ("extend", "branch")
    _age(db, ["old"], days=31, purged_days=32)
    _wait_for(lambda: len(_admin(gw, "GET", "/v1/audit", params={"action": "purge"}).json()["data"]) == 2)
    _assert_cleared(db, "old")
    if store is not None:
        _assert_leaves_the_files(store, [texts["old"], "qxz", "xzj", "zjv", "brand new question about otters", *[
            r for r in (replies["old"],) if r and len(r) > 12]])


def _indexed(db: Engine, session_id: str) -> int:
    """Calls of the session in SQLite's search index (store/search_index.py)."""
    with db.connect() as connection:
        return int(connection.execute(text("SELECT count(*) FROM call_search_rows WHERE session_id = :s"),
                                      {"s": session_id}).scalar_one())


def _old_sessions(db: Engine, prefix: str, n: int, *, days: float, owner: str | None = None,
                  policy: str = "default") -> list[str]:
    """`n` finished, rewarded one-call sessions last active `days` ago, written as the gateway writes them."""
    then = utcnow() - timedelta(days=days)
    ids = [f"{prefix}-{i}" for i in range(n)]
    with Session(db) as s:
        for sid in ids:
            s.add(AgentSession(id=sid, group_id=sid, owner=owner, status="final", created_at=then, updated_at=then,
                               model="tiny", calls=1, tokens=6, reward=1.0, policy=policy))
            s.add(Call(id=f"{sid}-c", completion_id=f"chatcmpl-{sid}", session_id=sid, group_id=sid, link="start",
                       model="tiny", prompt_tokens=3, completion_tokens=3, created_at=then, owner=owner,
                       state_hash=f"h{sid}", prompt_ids=encode_ids([1, 2, 3]), completion_ids=encode_ids([4, 5, 6]),
                       completion_logprobs=encode_floats([-1.0] * 3),
                       messages=[{"role": "user", "content": f"{sid} private plans for the orchard"}],
                       response_message={"role": "assistant", "content": f"{sid} noted the orchard plans"}))
            s.add(Reward(session_id=sid, value=1.0, final=True, created_at=then))
        s.commit()
    return ids


def test_a_purge_beside_live_traffic_loses_nothing_recent(tiny_engine: TransformersEngine, tiny_model_path: Path,
                                                          db_url: str) -> None:
    gw = _gateway(tiny_engine, tiny_model_path, db_url, retention_days=30, retention_interval_s=0.05)
    db = connect_db(db_url)
    failures: list[str] = []
    served: dict[str, int] = {}
    stop = threading.Event()

    def agent(worker: int) -> None:
        turn = 0
        while not stop.is_set():
            session = f"live-{worker}-{turn // 3}"
            try:
                _chat(gw, session, f"turn {turn} of worker {worker}")
                served[session] = served.get(session, 0) + 1
            except Exception as exc:
                failures.append(repr(exc))
            turn += 1

    workers = [threading.Thread(target=agent, args=(w,)) for w in range(4)]
    try:
        for thread in workers:
            thread.start()
        old = []
        for wave in range(3):  # old sessions keep arriving while the agents run: several purges meet traffic
            old += _old_sessions(db, f"old{wave}", 250, days=40)
            calls = sum(served.values())
            _wait_for(lambda: sum(served.values()) >= calls + 2)  # noqa: B023 (read while waiting)
        _wait_for(lambda: all(_purged(db, sid) == "retention" for sid in old[::50] + old[-1:]))
    finally:
        stop.set()
        for thread in workers:
            thread.join()
        gw.stop()
    assert not failures
    assert sum(served.values()) >= 6
    with Session(db) as s:
        assert s.exec(select(AgentSession.id).where(col(AgentSession.purged).is_not(None),
                                                    col(AgentSession.id).like("live-%"))).all() == []
        for session, calls in served.items():
            row = s.get(AgentSession, session)
            assert row is not None and row.calls == calls
            stored = s.exec(select(Call).where(Call.session_id == session)).all()
            assert len(stored) == calls and all(c.prompt_ids and c.state_hash != PURGED_STATE for c in stored)
        assert all(s.get(AgentSession, sid).purged == "retention" for sid in old)  # type: ignore[union-attr]
        assert s.exec(select(Call.id).where(col(Call.session_id).like("old%"),
                                            Call.state_hash != PURGED_STATE)).all() == []
    store = _sqlite_file(db_url)
    if store is not None:
        _assert_leaves_the_files(store, ["private plans for the orchard", "noted the orchard plans"])


def test_delete_erases_one_session_and_answers_bad_requests_in_the_api_format(
        retaining: RunningGateway, db_url: str) -> None:
    gw, db = retaining, retaining.gateway.db
    text = "please forget my address at 12 Juniper Lane"
    _chat(gw, "erase-me", text)
    _chat(gw, "keep-me", "nothing to forget here, dear gateway")
    _finish(gw, "erase-me")

    for headers, status, code in (({}, 401, "missing_api_key"), (_headers("wrong"), 401, "invalid_api_key"),
                                  (_headers(AGENT), 403, "admin_required")):
        refused = httpx.delete(f"{gw.url}/v1/sessions/erase-me", headers=headers)
        assert refused.status_code == status and refused.json()["error"]["code"] == code
    missing = _admin(gw, "DELETE", "/v1/sessions/no-such-session")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    bad = _admin(gw, "DELETE", "/v1/sessions/erase-me", json={"reason": "x", "extra": 1})
    assert bad.status_code == 400 and "error" in bad.json()
    assert _purged(db, "erase-me") is None, "a refused request changes nothing"

    erased = _admin(gw, "DELETE", "/v1/sessions/erase-me", json={"reason": "ticket 4711"})
    assert erased.status_code == 200, erased.text
    assert {k: erased.json()[k] for k in ("session_id", "purged", "calls_cleared", "already_deleted")} == {
        "session_id": "erase-me", "purged": "deleted", "calls_cleared": 1, "already_deleted": False}
    _assert_cleared(db, "erase-me")
    again = _admin(gw, "DELETE", "/v1/sessions/erase-me")
    assert again.status_code == 200 and again.json()["already_deleted"] is True
    assert again.json()["calls_cleared"] == 1 and again.json()["purged"] == "deleted"
    session = _admin(gw, "GET", "/v1/sessions/erase-me").json()
    assert session["purged"] == "deleted" and len(session["calls"]) == 1 and session["reward"] == 1.0
    assert '"session_id":"erase-me"' not in _admin(gw, "GET", "/v1/export").text
    # An old deleted session stays `deleted` when retention comes by.
    _age(db, ["erase-me"], days=31)
    time.sleep(0.6)
    assert _purged(db, "erase-me") == "deleted"
    (entry,) = _admin(gw, "GET", "/v1/audit", params={"action": "delete"}).json()["data"]
    assert (entry["session_id"], entry["actor"], entry["detail"]) == (
        "erase-me", fingerprint(ADMIN), {"reason": "ticket 4711", "calls": 1})
    assert _purged(db, "keep-me") is None
    store = _sqlite_file(db_url)
    if store is not None:
        _assert_not_in_files(store, [text])


def test_the_audit_log_lists_every_action_newest_first_with_filters_and_pages(retaining: RunningGateway) -> None:
    gw = retaining
    for session in ("a", "b", "c"):
        _chat(gw, session, f"session {session} says hello")
    assert _admin(gw, "POST", "/v1/sessions/a/exclude", json={"note": "looks off"}).status_code == 200
    assert _admin(gw, "POST", "/v1/sessions/b/no_train").status_code == 200
    assert _admin(gw, "GET", "/v1/export").status_code == 200
    assert _admin(gw, "DELETE", "/v1/sessions/c", json={"reason": "user asked"}).status_code == 200
    _age(gw.gateway.db, ["a"], days=31)
    _wait_for(lambda: _purged(gw.gateway.db, "a") == "retention")

    log = _admin(gw, "GET", "/v1/audit").json()
    assert [e["action"] for e in log["data"]] == ["purge", "delete", "export", "no_train", "correction"]
    assert log["total"] == 5 and log["has_more"] is False
    purge, delete, export, no_train, correction = log["data"]
    assert (export["actor"], export["sessions"], export["detail"]) == (fingerprint(ADMIN), 2, {"format": "jsonl"})
    assert (no_train["session_id"], no_train["detail"]["correction"]) == ("b", "no_train")
    assert (correction["session_id"], correction["detail"]["note"], correction["detail"]["new_value"]) == (
        "a", "looks off", {"excluded": True})
    assert (delete["session_id"], delete["detail"]["reason"]) == ("c", "user asked")
    assert (purge["actor"], purge["sessions"], purge["session_id"]) == ("retention", 1, None)
    assert all(e["actor"] != ADMIN for e in log["data"]), "never the raw key"

    page = _admin(gw, "GET", "/v1/audit", params={"limit": 2, "offset": 2}).json()
    assert [e["id"] for e in page["data"]] == [export["id"], no_train["id"]] and page["has_more"] is True
    about_a = _admin(gw, "GET", "/v1/audit", params={"session_id": "a"}).json()["data"]
    assert [e["action"] for e in about_a] == ["correction"]
    assert [e["action"] for e in _admin(gw, "GET", "/v1/audit", params={"action": "correction"}).json()["data"]] == [
        "correction"]
    assert _admin(gw, "GET", "/v1/audit", params={"action": "nonsense"}).status_code == 400
    assert httpx.get(f"{gw.url}/v1/audit", headers=_headers(AGENT)).status_code == 403
    assert httpx.get(f"{gw.url}/v1/audit").status_code == 401


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracetrain.cli", *args], capture_output=True, text=True, timeout=300)


def test_db_purge_clears_what_is_past_each_keys_retention(db_url: str, tmp_path: Path) -> None:
    db = open_db(db_url)
    agent, keeper, short = fingerprint(AGENT), fingerprint(KEEPER), fingerprint("short-key")
    by_default = _old_sessions(db, "anon", 3, days=40) + _old_sessions(db, "agent", 2, days=40, owner=agent)
    kept = (_old_sessions(db, "keeper", 2, days=400, owner=keeper) + _old_sessions(db, "young", 2, days=10)
            + _old_sessions(db, "short-young", 1, days=1, owner=short))
    by_key = _old_sessions(db, "short", 2, days=6, owner=short)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"gateway": {"api_keys": [AGENT, {"key": KEEPER, "retention_days": None},
                                                               {"key": "short-key", "retention_days": 5}]}}))

    unset = _cli("--config", str(config), "db", "purge", "--db-url", db_url)
    assert unset.returncode == 0 and "nothing to purge" not in unset.stdout, unset.stderr  # the key's 5 days
    assert "purged the content of 2 sessions" in unset.stdout
    done = _cli("--config", str(config), "db", "purge", "--db-url", db_url, "--retention-days", "30")
    assert done.returncode == 0, done.stderr
    assert "purged the content of 5 sessions" in done.stdout
    with Session(db) as s:
        state = {sid: s.get(AgentSession, sid).purged for sid in by_default + kept + by_key}  # type: ignore[union-attr]
    assert state == {**{sid: "retention" for sid in by_default + by_key}, **{sid: None for sid in kept}}
    for sid in by_default:
        _assert_cleared(db, sid)
    again = _cli("--config", str(config), "db", "purge", "--db-url", db_url, "--retention-days", "30")
    assert again.returncode == 0 and "purged the content of 0 sessions" in again.stdout
    no_retention = _cli("db", "purge", "--db-url", db_url)
    assert no_retention.returncode == 0 and "nothing to purge" in no_retention.stdout
    export = _cli("export", "--db-url", db_url, "--out", str(tmp_path / "out.jsonl"))
    assert export.returncode == 0, export.stderr
    rows = (tmp_path / "out.jsonl").read_text()
    assert all(f'"session_id":"{sid}"' not in rows for sid in by_default + by_key)
    assert all(f'"session_id":"{sid}"' in rows for sid in kept)
    with Session(db) as s:
        from tracetrain.store import audit

        entries, total = audit.entries(s)
        assert [(e.action, e.actor, e.sessions) for e in entries] == [
            ("export", "cli", len(kept)), ("purge", "cli", 5), ("purge", "cli", 2)]
    store = _sqlite_file(db_url)
    if store is not None:
        _assert_not_in_files(store, [f"{sid} private plans" for sid in by_default + by_key])


def test_a_deleted_response_is_neither_read_back_nor_continued(retaining: RunningGateway) -> None:
    gw = retaining
    created = httpx.post(f"{gw.v1('responding')}/responses", headers=_headers(AGENT), timeout=60,
                         json={"model": "tiny", "input": "remember the violet umbrella", "max_output_tokens": 4})
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    assert httpx.get(f"{gw.url}/v1/responses/{response_id}", headers=_headers(AGENT)).status_code == 200
    assert _admin(gw, "DELETE", "/v1/sessions/responding").status_code == 200
    read = httpx.get(f"{gw.url}/v1/responses/{response_id}", headers=_headers(AGENT))
    assert read.status_code == 404 and read.json()["error"]["code"] == "response_not_found"
    continued = httpx.post(f"{gw.url}/v1/responses", headers=_headers(AGENT), timeout=60, json={
        "model": "tiny", "input": "and then?", "previous_response_id": response_id, "max_output_tokens": 4})
    assert continued.status_code == 404 and continued.json()["error"]["code"] == "response_not_found"


def test_a_policy_keeps_its_sessions_as_long_as_its_own_retention_says(db_url: str, tmp_path: Path) -> None:
    """The most specific rule wins: a key's own retention, else the session's policy's (stored with the
    policy, so one created over the API counts), else the gateway's."""
    from tracetrain.store import policy_lines

    db = open_db(db_url)
    with Session(db) as s:
        policy_lines.create(s, name="brief", training="lora", settings={"retention_days": 3})
        policy_lines.create(s, name="archive", training="lora", settings={"retention_days": None})
        policy_lines.create(s, name="plain", training="lora", settings={"lr": 1e-4})
    keeper = fingerprint(KEEPER)
    brief_old = _old_sessions(db, "brief-old", 2, days=5, policy="brief")
    brief_young = _old_sessions(db, "brief-young", 1, days=1, policy="brief")
    archived = _old_sessions(db, "archive", 2, days=400, policy="archive")
    plain_old = _old_sessions(db, "plain-old", 1, days=40, policy="plain")  # follows the gateway's 30 days
    kept_by_key = _old_sessions(db, "keeper", 1, days=40, owner=keeper, policy="brief")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"gateway": {"api_keys": [{"key": KEEPER, "retention_days": None}]}}))

    only_policies = _cli("--config", str(config), "db", "purge", "--db-url", db_url)
    assert only_policies.returncode == 0 and "purged the content of 2 sessions" in only_policies.stdout, (
        only_policies.stdout + only_policies.stderr)
    with_gateway = _cli("--config", str(config), "db", "purge", "--db-url", db_url, "--retention-days", "30")
    assert with_gateway.returncode == 0 and "purged the content of 1 sessions" in with_gateway.stdout
    with Session(db) as s:
        state = {sid: s.get(AgentSession, sid).purged  # type: ignore[union-attr]
                 for sid in brief_old + brief_young + archived + plain_old + kept_by_key}
    assert state == {**{sid: "retention" for sid in brief_old + plain_old},
                     **{sid: None for sid in brief_young + archived + kept_by_key}}
    for sid in brief_old + plain_old:
        _assert_cleared(db, sid)
