"""The console's JSON API over real HTTP: an admin's corrections (exclude, include, reward override and
clearing it), audited with who and when, refused to agent keys and on bad input; the trainer honours
them; the session list filters, sorts and pages, each key seeing its own sessions, and its text search
(through the index of migration 0005, on new and on upgraded stores) finds what a scan finds; each
call's tool calls and tool results as items of the session JSON; capture quality."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic import command
from openai import OpenAI
from sqlalchemy import inspect
from sqlalchemy import text as sql
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tests.support.sessions import add_session
from tests.support.tool_model import ADD_TOOL, QUESTION
from tracetrain.config import TrainConfig
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.proxy.auth import fingerprint
from tracetrain.proxy.console_protocol import message_items
from tracetrain.store import console, corrections, leases, schema, search_index
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import connect_db, open_db
from tracetrain.store.models import AgentSession, Call
from tracetrain.trainer.batch import BatchGatherer
from tracetrain.trainer.data import load_samples
from tracetrain.trainer.loop import Trainer

MODEL = "tiny"
ADMIN = {"Authorization": "Bearer admin"}
AGENT_A = {"Authorization": "Bearer agent-a"}
AGENT_B = {"Authorization": "Bearer agent-b"}


@pytest.fixture
def keyed(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'console.db'}",
                            gateway={"api_keys": ["agent-a", "agent-b"], "admin_key": "admin"})
    yield running
    running.stop()


def _call(gw: RunningGateway, key: str, session: str, text: str = "hi", group: str | None = None) -> None:
    OpenAI(base_url=gw.v1(session, group), api_key=key, max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2)


def _get(gw: RunningGateway, path: str, headers: dict[str, str] | None = None, **params: Any) -> httpx.Response:
    return httpx.get(gw.url + path, headers=headers, params=params, timeout=30)


def _post(gw: RunningGateway, path: str, body: Any = None, headers: dict[str, str] | None = None,
          content: str | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(gw.url + path, content=content, headers={**(headers or {}),
                                                                   "Content-Type": "application/json"}, timeout=30)
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=30)


def _delete(gw: RunningGateway, path: str, body: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.request("DELETE", gw.url + path, json=body, headers=headers, timeout=30)


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert {"message", "type", "code", "param"} <= error.keys()
    if code is not None:
        assert error["code"] == code
    return error


def test_corrections_are_admin_only_validated_and_audited(keyed: RunningGateway) -> None:
    _call(keyed, "agent-a", "c-1")
    assert _post(keyed, "/v1/rewards", {"session_id": "c-1", "reward": 1.0, "final": True}, AGENT_A).status_code == 200
    base = "/v1/sessions/c-1"
    for path, body in (("exclude", {"note": "x"}), ("include", None), ("reward_override", {"reward": 0, "note": ""})):
        _error(_post(keyed, f"{base}/{path}", body, AGENT_A), 403, "admin_required")
    _error(_get(keyed, f"{base}/actions", AGENT_A), 403, "admin_required")
    _error(_post(keyed, f"{base}/exclude", None), 401, "missing_api_key")
    for path in ("exclude", "include"):
        _error(_post(keyed, f"/v1/sessions/nope/{path}", None, ADMIN), 404, "session_not_found")
    _error(_post(keyed, "/v1/sessions/nope/reward_override", {"reward": 1, "note": ""}, ADMIN), 404,
           "session_not_found")
    _error(_get(keyed, "/v1/sessions/nope/actions", ADMIN), 404, "session_not_found")

    # bad input: 400 in OpenAI's shape, and nothing changes
    for body in ({"reward": "abc", "note": ""}, {"reward": "0.5", "note": ""}, {"note": "no reward"},
                 {"reward": 0.5}, {"reward": None, "note": ""}, {"reward": True, "note": ""},
                 {"reward": 0.5, "note": "", "extra": 1}):
        _error(_post(keyed, f"{base}/reward_override", body, ADMIN), 400)
    for raw in ('{"reward": NaN, "note": ""}', '{"reward": Infinity, "note": ""}', '{"reward": 1e999, "note": ""}',
                "{not json"):
        _error(_post(keyed, f"{base}/reward_override", headers=ADMIN, content=raw), 400)
    _error(_post(keyed, f"{base}/exclude", {"note": 5}, ADMIN), 400)
    _error(_post(keyed, f"{base}/exclude", {"reason": "x"}, ADMIN), 400)
    assert _get(keyed, f"{base}/actions", ADMIN).json() == {"object": "list", "data": []}
    session = _get(keyed, base, AGENT_A).json()
    assert (session["excluded"], session["reward"], session["reward_override"]) == (False, 1.0, None)

    admin = fingerprint("admin")
    excluded = _post(keyed, f"{base}/exclude", {"note": "reward hacking"}, ADMIN)
    assert excluded.status_code == 200, excluded.text
    assert excluded.json()["excluded"] is True and excluded.json()["action"]["actor"] == admin
    assert _get(keyed, base, AGENT_A).json()["excluded"] is True, "the owner sees it was excluded"
    overridden = _post(keyed, f"{base}/reward_override", {"reward": 0.25, "note": "judge was wrong"}, ADMIN).json()
    assert (overridden["reward"], overridden["reward_override"]) == (0.25, 0.25)
    included = _post(keyed, f"{base}/include", None, ADMIN).json()  # no body: no note
    assert included["excluded"] is False and included["action"]["note"] == ""
    # a reward posted after the override does not change the reward the trainer uses
    assert _post(keyed, "/v1/rewards", {"session_id": "c-1", "reward": 5.0}, AGENT_A).status_code == 200
    session = _get(keyed, base, ADMIN).json()
    assert (session["reward"], session["reward_override"], session["reward_total"]) == (0.25, 0.25, 6.0)

    actions = _get(keyed, f"{base}/actions", ADMIN).json()["data"]
    assert [(a["action"], a["actor"], a["note"], a["old_value"], a["new_value"]) for a in actions] == [
        ("exclude", admin, "reward hacking", {"excluded": False}, {"excluded": True}),
        ("reward_override", admin, "judge was wrong", {"reward": 1.0, "reward_override": None},
         {"reward": 0.25, "reward_override": 0.25}),
        ("include", admin, "", {"excluded": True}, {"excluded": False}),
    ]
    assert all(a["session_id"] == "c-1" and a["created_at"] for a in actions)
    assert actions[0]["created_at"] <= actions[1]["created_at"] <= actions[2]["created_at"]


def test_an_admin_clears_a_reward_override_and_the_posted_rewards_count_again(keyed: RunningGateway) -> None:
    _call(keyed, "agent-a", "o-1")
    _call(keyed, "agent-a", "o-2")  # no reward posted, ever
    for reward in ({"reward": 1.0}, {"reward": 0.5, "final": True}):
        assert _post(keyed, "/v1/rewards", {"session_id": "o-1", **reward}, AGENT_A).status_code == 200
    path = "/v1/sessions/o-1/reward_override"
    _error(_delete(keyed, path, None, AGENT_A), 403, "admin_required")
    _error(_delete(keyed, path), 401, "missing_api_key")
    _error(_delete(keyed, "/v1/sessions/nope/reward_override", None, ADMIN), 404, "session_not_found")
    _error(_delete(keyed, path, None, ADMIN), 409, "no_reward_override")
    for body in ({"note": 5}, {"reward": 1.0}, {"note": "x" * 4001}):
        _error(_delete(keyed, path, body, ADMIN), 400)
    assert _post(keyed, path, {"reward": 0.0, "note": "judge was wrong"}, ADMIN).status_code == 200
    _error(_delete(keyed, path, None, AGENT_A), 403, "admin_required")
    assert _get(keyed, "/v1/sessions/o-1", AGENT_A).json()["reward_override"] == 0.0, "an agent's 403 changed nothing"

    cleared = _delete(keyed, path, {"note": "the judge was right after all"}, ADMIN)
    assert cleared.status_code == 200, cleared.text
    body = cleared.json()
    assert (body["session_id"], body["reward"], body["reward_override"]) == ("o-1", 1.5, None)
    action = body["action"]
    assert (action["action"], action["actor"], action["note"]) == (
        "clear_reward_override", fingerprint("admin"), "the judge was right after all")
    _error(_delete(keyed, path, None, ADMIN), 409, "no_reward_override")
    # rewards posted from now on count again, and the trainer reads them
    assert _post(keyed, "/v1/rewards", {"session_id": "o-1", "reward": 0.25}, AGENT_A).status_code == 200
    session = _get(keyed, "/v1/sessions/o-1", AGENT_A).json()
    assert (session["reward"], session["reward_override"], session["reward_total"]) == (1.75, None, 1.75)
    with Session(open_db(keyed.gateway.config.store.url)) as db:
        assert {x.reward for x in load_samples(db, ["o-1"])} == {1.75}
    listed = _get(keyed, "/v1/sessions", ADMIN, reward_min=1.7).json()["data"]
    assert [s["id"] for s in listed] == ["o-1"], "the list filters on the posted rewards again"
    actions = _get(keyed, "/v1/sessions/o-1/actions", ADMIN).json()["data"]
    assert [(a["action"], a["old_value"], a["new_value"]) for a in actions] == [
        ("reward_override", {"reward": 1.5, "reward_override": None}, {"reward": 0.0, "reward_override": 0.0}),
        ("clear_reward_override", {"reward": 0.0, "reward_override": 0.0}, {"reward": 1.5, "reward_override": None}),
    ]
    assert actions[1]["created_at"] >= actions[0]["created_at"]

    # a session with no posted reward has none again; no body: no note
    assert _post(keyed, "/v1/sessions/o-2/reward_override", {"reward": 1.0, "note": ""}, ADMIN).status_code == 200
    cleared = _delete(keyed, "/v1/sessions/o-2/reward_override", None, ADMIN)
    assert cleared.status_code == 200, cleared.text
    assert (cleared.json()["reward"], cleared.json()["action"]["note"]) == (None, "")

    document = httpx.get(f"{keyed.url}/openapi.json").json()
    operation = document["paths"]["/v1/sessions/{session_id}/reward_override"]["delete"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/CorrectionResponse")
    assert {"403", "404", "409"} <= operation["responses"].keys()


def test_the_trainer_skips_excluded_sessions_and_learns_the_overridden_reward(
        gateway: RunningGateway, tiny_model_path: Path, tmp_path: Path) -> None:
    rewards = {"a0": 1.0, "a1": 1.0, "b0": 0.0, "b1": 1.0, "b2": 1.0}
    for sid, reward in rewards.items():
        _call(gateway, "unused", sid, group=f"g-{sid[0]}")
        assert _post(gateway, "/v1/rewards", {"session_id": sid, "reward": reward, "final": True}).status_code == 200
    # g-a scored the same twice (no signal for a group baseline) until the admin corrects a1
    assert _post(gateway, "/v1/sessions/a1/reward_override", {"reward": 0.0, "note": "wrong answer"}).status_code == 200
    assert _post(gateway, "/v1/sessions/b2/exclude", {"note": "leaked the answer"}).status_code == 200
    policies = _get(gateway, "/v1/policies").json()["sessions"]
    assert policies == {"ready": 4, "leased": 0, "set_aside": {"excluded": 1}}

    db = open_db(gateway.gateway.config.store.url)
    with Session(db) as s:
        by_session = {x.session_id: x.reward for x in load_samples(s, list(rewards))}
    assert by_session == {"a0": 1.0, "a1": 0.0, "b0": 0.0, "b1": 1.0, "b2": 1.0}, "the override is the reward"
    # All-equal groups set aside, so that a group the override left flat would show as one.
    cfg = TrainConfig(lora=False, lr=1e-3, batch_sessions=8, min_sessions=1, flat_groups="set_aside",
                      checkpoint_dir=tmp_path / "ckpt")
    trainer = Trainer(cfg, db, tiny_model_path)
    assert trainer.step_once() and trainer.version == 1
    assert trainer.counts["zero_variance"] == 0, "a1's override gave g-a a signal"
    listed = _get(gateway, "/v1/policies").json()
    figures = listed["data"][-1]["metrics"]
    assert figures["sessions"] == 4 and figures["reward_mean"] == pytest.approx(0.5)
    assert listed["sessions"] == {"ready": 0, "leased": 0, "set_aside": {"excluded": 1}}
    trained = {row["id"]: row["trained_version"] for row in _get(gateway, "/v1/sessions").json()["data"]}
    assert trained == {"a0": 1, "a1": 1, "b0": 1, "b1": 1, "b2": None}
    assert trainer.step_once() is False, "nothing else to train on: b2 stays out"

    assert _post(gateway, "/v1/sessions/b2/include", {"note": "checked again"}).status_code == 200
    assert _get(gateway, "/v1/policies").json()["sessions"] == {"ready": 1, "leased": 0, "set_aside": {}}


def test_excluded_sessions_are_never_claimed_on_either_store(db_url: str, tmp_path: Path) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        for i in range(3):
            add_session(s, f"s{i}", "g", float(i))
        s.commit()
        assert corrections.set_excluded(s, session_id="s1", excluded=True, actor="a" * 32, note="n") is not None
        assert corrections.override_reward(s, session_id="s2", reward=-1.0, actor=None) is not None
        assert corrections.set_excluded(s, session_id="missing", excluded=True, actor=None) is None
        s.commit()
        assert leases.ready_count(s) == 2
        assert leases.set_aside_counts(s) == {"excluded": 1}
        # offline consumers (SFT, DPO, export jobs) do not get it either
        assert sorted(leases.claim_sessions(s, trainer_id="offline", limit=10, lease_s=-1)) == ["s0", "s2"]
        assert sorted(leases.claim_groups(s, trainer_id="sft", want=10, lease_s=-1, min_version=None,
                                          settle_s=0, include_set_aside=True)) == ["s0", "s2"]
        assert [a.action for a in corrections.session_actions(s, session_id="s1")] == ["exclude"]
    gatherer = BatchGatherer(TrainConfig(batch_sessions=4, min_sessions=1, checkpoint_dir=tmp_path), db, "t")
    batch = gatherer.gather(0)
    assert batch is not None and sorted(batch.session_ids) == ["s0", "s2"]
    assert sorted(x.reward for x in batch.samples) == [-1.0, 0.0]


def test_the_session_list_filters_sorts_and_pages_per_key(keyed: RunningGateway) -> None:
    for i in range(5):
        _call(keyed, "agent-a", f"a-{i}", text=f"question {i}" + (" about the ZEBRA" if i % 2 else ""),
              group="odd" if i % 2 else "even")
        _post(keyed, "/v1/rewards", {"session_id": f"a-{i}", "reward": i / 4, "final": i < 4}, AGENT_A)
    _call(keyed, "agent-a", "a-5", text="one more")  # open, no reward yet
    _call(keyed, "agent-a", "a-5", text="and another")  # a new segment of the same session
    _call(keyed, "agent-b", "b-0", text="zebra crossing")
    assert _post(keyed, "/v1/sessions/a-3/exclude", None, ADMIN).status_code == 200

    def ids(headers: dict[str, str], **params: Any) -> list[str]:
        response = _get(keyed, "/v1/sessions", headers, **params)
        assert response.status_code == 200, response.text
        return [s["id"] for s in response.json()["data"]]

    assert ids(AGENT_A) == ["a-5", "a-4", "a-3", "a-2", "a-1", "a-0"], "newest first, only agent-a's"
    assert ids(AGENT_B) == ["b-0"]
    assert set(ids(ADMIN)) == {"a-0", "a-1", "a-2", "a-3", "a-4", "a-5", "b-0"}
    assert ids(AGENT_A, q="zebra") == ["a-3", "a-1"] and ids(ADMIN, q="Zebra") == ["b-0", "a-3", "a-1"]
    # Wildcards are plain characters: only a session whose text holds one is found. The questions hold
    # none; the tiny model's random replies may.
    replies = {sid: " ".join(str(c["response_message"].get("content")) for c in _get(keyed, f"/v1/sessions/{sid}",
                                                                                        ADMIN).json()["calls"])
               for sid in ids(ADMIN)}
    for wildcard in ("%", "_"):
        assert set(ids(ADMIN, q=wildcard)) == {sid for sid, text in replies.items() if wildcard in text}, wildcard
    assert ids(AGENT_A, status="open") == ["a-5", "a-4"]
    assert ids(AGENT_A, reward_min=0.25, reward_max=0.5) == ["a-2", "a-1"]
    assert ids(AGENT_A, group="odd") == ["a-3", "a-1"]
    assert ids(AGENT_A, model=MODEL) == ids(AGENT_A) and ids(AGENT_A, model="other") == []
    assert ids(AGENT_A, excluded=True) == ["a-3"] and "a-3" not in ids(AGENT_A, excluded=False)
    assert ids(AGENT_A, trained=True) == []
    assert ids(AGENT_A, sort="reward", order="asc") == ["a-0", "a-1", "a-2", "a-3", "a-4", "a-5"], \
        "no reward: last"
    assert ids(AGENT_A, sort="calls")[0] == "a-5"
    assert ids(AGENT_A, sort="tokens")[0] == "a-5"

    page = _get(keyed, "/v1/sessions", AGENT_A, limit=4, offset=0, sort="created", order="asc").json()
    assert [s["id"] for s in page["data"]] == ["a-0", "a-1", "a-2", "a-3"]
    assert (page["total"], page["has_more"], page["limit"], page["offset"]) == (6, True, 4, 0)
    rest = _get(keyed, "/v1/sessions", AGENT_A, limit=4, offset=4, sort="created", order="asc").json()
    assert [s["id"] for s in rest["data"]] == ["a-4", "a-5"] and (rest["total"], rest["has_more"]) == (6, False)

    row = next(s for s in page["data"] if s["id"] == "a-1")
    # the fields the list always had, and the new ones
    assert {"id", "group_id", "status", "created_at", "updated_at"} <= row.keys()
    assert (row["group_id"], row["status"], row["reward"], row["model"], row["calls"]) == ("odd", "final", 0.25,
                                                                                           MODEL, 1)
    assert row["tokens"] > 0 and (row["policy_version_min"], row["policy_version_max"]) == (0, 0)
    stored = _get(keyed, "/v1/sessions/a-5", AGENT_A).json()
    assert len(stored["calls"]) == 2 == next(s for s in _get(keyed, "/v1/sessions", AGENT_A).json()["data"]
                                             if s["id"] == "a-5")["calls"]

    for params in ({"sort": "age"}, {"order": "up"}, {"status": "done"}, {"reward_min": "nan"},
                   {"reward_max": "x"}, {"excluded": "maybe"}, {"limit": 0}, {"q": ""}):
        _error(_get(keyed, "/v1/sessions", AGENT_A, **params), 400)


def _stored_call(sid: str, n: int, messages: list[dict[str, Any]], reply: dict[str, Any], inherited: int = 0,
                 parent: str | None = None) -> Call:
    return Call(id=f"{sid}-c{n}", completion_id=f"chatcmpl-{sid}-{n}", session_id=sid, group_id="g1", seq=n,
                parent_id=parent, link="extend" if parent else "start", model="tiny", state_hash=f"{sid}-{n}",
                prompt_ids=encode_ids([1]), completion_ids=encode_ids([2]), completion_logprobs=encode_floats([-1.0]),
                messages=messages, messages_inherited=inherited, response_message=reply)


TOOL_TURN = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Reykjavik"}'}}]}


def _tool_session(db: Session, sid: str = "tools") -> None:
    """Two calls: the first replies with a tool call, the second sends the tool's result (stored as the
    messages it added: the first call's reply and the result)."""
    db.add(AgentSession(id=sid, group_id="g1", model="tiny"))
    db.add(_stored_call(sid, 0, [{"role": "user", "content": "What is the weather?"}], TOOL_TURN))
    result = {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, QuokkaSeven"}
    db.add(_stored_call(sid, 1, [TOOL_TURN, result], {"role": "assistant", "content": "It is sunny."}, inherited=1,
                        parent=f"{sid}-c0"))


def test_the_session_list_filters_on_either_store(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        for i in range(4):
            add_session(s, f"s{i}", f"g{i % 2}", float(i))
        s.add(AgentSession(id="text", group_id="g1", model="tiny"))
        s.add(Call(id="text-c", completion_id="chatcmpl-text", session_id="text", group_id="g1", link="start",
                   model="tiny", state_hash="text", prompt_ids=encode_ids([1]), completion_ids=encode_ids([2]),
                   completion_logprobs=encode_floats([-1.0]), response_message={"role": "assistant", "content": "ok"},
                   messages=[{"role": "user", "content": "Où est le Zèbre? 100%"}]))
        s.commit()
    with Session(db) as s:
        page, total = console.search_sessions(s, where=console.SessionFilter(), sort="created", limit=2)
        assert len(page) == 2 and total == 5
        for text, found in (("zèbre", ["text"]), ("EST LE", ["text"]), ("100%", ["text"]), ("0%", ["text"]),
                            ("1_0", []), ("%", ["text"]), ("le zebre", [])):
            # case-insensitive (ASCII letters everywhere), wildcards taken literally
            rows, total = console.search_sessions(s, where=console.SessionFilter(text=text))
            assert [r.id for r in rows] == found and total == len(found), text
        assert console.search_sessions(s, where=console.SessionFilter(group_id="g1", text="zzz"))[1] == 0
        _tool_session(s)
        s.commit()
        searches = {"quokkaseven": ["tools"],  # only in a tool result, added by the session's second call
                    "QUOKKA": ["tools"], "reykjavik": ["tools"],  # a tool call's arguments, in the reply
                    "It Is Sunny": ["tools"], "TOOL_CALL_ID": ["tools"], "sunny, quokka": ["tools"],
                    "zèbre": ["text"], "100%": ["text"], "sunny quokka": [], "quokkaseven!": []}

        def results() -> dict[str, list[str]]:
            return {q: [r.id for r in console.search_sessions(s, where=console.SessionFilter(text=q))[0]]
                    for q in searches}

        assert results() == searches  # SQLite: the calls are not indexed yet, the search reads them
        if search_index.batched(s):
            assert search_index.index_new_calls(s) == 7  # every call stored above
            s.commit()
        assert results() == searches  # SQLite: now through the index
        # A common text pages by scanning sessions in order (and counts through the index): same answers.
        monkeypatch.setattr(console, "COMMON_CALLS", 1)
        assert results() == searches
        page, total = console.search_sessions(s, where=console.SessionFilter(text="role"), limit=2)
        assert len(page) == 2 and total == 2, "only the stored messages of 'text' and 'tools' have a role"
        monkeypatch.undo()
        # The index follows the calls: a changed message, a deleted call.
        s.exec(sql("UPDATE calls SET messages = '[{\"content\": \"Wombat\"}]' WHERE id = 'tools-c1'"))  # type: ignore[call-overload]
        s.commit()
        assert [r.id for r in console.search_sessions(s, where=console.SessionFilter(text="wombat"))[0]] == ["tools"]
        assert console.search_sessions(s, where=console.SessionFilter(text="quokkaseven"))[1] == 0
        s.exec(sql("DELETE FROM calls WHERE session_id = 'tools'"))  # type: ignore[call-overload]
        s.commit()
        assert console.search_sessions(s, where=console.SessionFilter(text="wombat"))[1] == 0
        assert console.search_sessions(s, where=console.SessionFilter(text="reykjavik"))[1] == 0
        corrections.override_reward(s, session_id="s1", reward=9.0, actor=None)
        s.commit()
        top, _ = console.search_sessions(s, where=console.SessionFilter(reward_min=5), sort="reward")
        assert [row.id for row in top] == ["s1"]
        assert console.version_spans(s, session_ids=["s0", "text"]) == {"s0": (0, 0), "text": (0, 0)}


def test_an_upgraded_store_searches_its_earlier_calls_through_the_index(db_url: str) -> None:
    """Migration 0005 indexes the calls already stored (on SQLite its triggers then keep new ones)."""
    db = connect_db(db_url)
    with db.begin() as connection:
        command.upgrade(schema._config(connection), "0004")
    with db.begin() as connection:  # rows as 0004 has them
        connection.execute(sql("INSERT INTO sessions (id, group_id, status, created_at, updated_at, calls, tokens, "
                                "excluded) VALUES ('old', 'g', 'open', '2026-01-01', '2026-01-01', 1, 2, false)"))
        connection.execute(
            sql("INSERT INTO calls (id, completion_id, choice_index, session_id, group_id, seq, link, model, "
                 "policy_version, prefix_len, prompt_tokens, completion_tokens, latency_ms, created_at, state_hash, "
                 "prompt_ids, completion_ids, completion_logprobs, messages, messages_inherited, response_message, "
                 "request_params) VALUES ('old-c', 'chatcmpl-old', 0, 'old', 'g', 0, 'start', 'tiny', 0, 0, 1, 1, "
                 "0.0, '2026-01-01', 'h', :ids, :ids, :logprobs, :messages, 0, :reply, '{}')"),
            {"ids": encode_ids([1]), "logprobs": encode_floats([-1.0]), "messages": '[{"role": "tool", "content": '
             '"Platypus"}]', "reply": '{"role": "assistant", "content": "ok"}'})
    schema.upgrade(db)
    with Session(open_db(db_url)) as s:
        _tool_session(s, "new")
        s.commit()
        for q, found in (("PLATYPUS", ["old"]), ("quokkaseven", ["new"]), ("PLATYPUS!", [])):
            assert [r.id for r in console.search_sessions(s, where=console.SessionFilter(text=q))[0]] == found, q
        if db.dialect.name == "sqlite":  # the earlier call indexed by the migration, the new ones in a batch
            assert s.exec(sql("SELECT count(*) FROM call_search_rows")).one() == (1,)  # type: ignore[call-overload]
            assert search_index.index_new_calls(s) == 2
            s.commit()
            for q, found in (("PLATYPUS", ["old"]), ("quokkaseven", ["new"])):
                assert [r.id for r in console.search_sessions(s, where=console.SessionFilter(text=q))[0]] == found
        else:
            indexes = s.exec(sql("SELECT indexname FROM pg_indexes WHERE tablename = 'calls'")).all()  # type: ignore[call-overload]
            assert {"ix_calls_messages_trgm", "ix_calls_response_message_trgm"} <= {i for (i,) in indexes}


def test_downgrading_from_batched_indexing_indexes_what_was_pending(tmp_path: Path) -> None:
    """0007 → 0006 puts back the per-call trigger, which would never index calls recorded since the last
    batch: the downgrade indexes them first; up again, the mark starts past every call."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with Session(open_db(url)) as s:
        _tool_session(s)
        s.commit()
    db = connect_db(url)
    with db.begin() as connection:
        command.downgrade(schema._config(connection), "0006")
    rows = sql("SELECT count(*) FROM call_search_rows")
    with db.connect() as connection:
        assert connection.execute(rows).one() == (2,)
    call = _stored_call("tools", 2, [{"role": "user", "content": "Echidna"}], {"role": "assistant", "content": "ok"})
    with db.begin() as connection:  # the trigger indexes as calls are written
        # The columns of 0006's `calls` only: the model carries those added since.
        present = {column["name"] for column in inspect(connection).get_columns("calls")}
        table = Call.__table__  # type: ignore[attr-defined]
        connection.execute(table.insert().values({k: v for k, v in call.model_dump().items() if k in present}))
    with db.connect() as connection:
        assert connection.execute(rows).one() == (3,)
    schema.upgrade(db)
    with Session(db) as s:
        assert search_index.index_new_calls(s) == 0
        assert [r.id for r in console.search_sessions(s, where=console.SessionFilter(text="echidna"))[0]] == ["tools"]


def test_the_gateway_indexes_its_calls_in_the_background(gateway: RunningGateway) -> None:
    client = OpenAI(base_url=gateway.v1("indexed"), api_key="unused")
    client.chat.completions.create(model=gateway.gateway.config.engine.served_model_name, max_tokens=4,
                                   messages=[{"role": "user", "content": "Say Numbat."}])
    db = open_db(gateway.gateway.config.store.url)
    deadline = time.monotonic() + 10
    with db.connect() as connection:
        while connection.execute(sql("SELECT count(*) FROM call_search_rows")).one() != (1,):
            assert time.monotonic() < deadline, "the call was not indexed"
            time.sleep(0.2)
        marked = connection.execute(sql("SELECT indexed_rowid FROM call_search_state")).one()
        assert marked == connection.execute(sql("SELECT max(rowid) FROM calls")).one()


def test_a_deleted_newest_call_s_rowid_given_again_is_indexed_again(tmp_path: Path) -> None:
    """SQLite hands the rowid of a deleted newest row out again: the mark steps back, so the call that gets
    it is searched (past the mark) and then indexed, not skipped as indexed already."""
    with Session(open_db(f"sqlite:///{tmp_path / 'store.db'}")) as db:
        _tool_session(db)
        db.commit()
        assert search_index.index_new_calls(db) == 2
        db.commit()
        db.exec(sql("DELETE FROM calls WHERE id = 'tools-c1'"))  # type: ignore[call-overload]
        db.add(_stored_call("tools", 1, [{"role": "user", "content": "Echidna"}], {"role": "assistant",
                                                                                  "content": "ok"}))
        db.commit()
        found = [r.id for r in console.search_sessions(db, where=console.SessionFilter(text="echidna"))[0]]
        assert found == ["tools"]
        assert search_index.index_new_calls(db) == 1
        db.commit()
        matches = sql("SELECT count(*) FROM call_search WHERE call_search MATCH 'echidna'")
        assert db.exec(matches).one() == (1,)  # type: ignore[call-overload]
        assert search_index.index_new_calls(db) == 0


def test_message_items_read_every_api_s_tool_calls_and_results() -> None:
    names = {"toolu_1": "add"}
    anthropic_result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "5"}]},
        {"type": "text", "text": "Now double it."}]}
    assert [i.model_dump(exclude_defaults=True) for i in message_items(anthropic_result, names)] == [
        {"type": "tool_result", "text": "5", "tool_call_id": "toolu_1", "name": "add"},
        {"type": "message", "role": "user", "text": "Now double it."}]
    anthropic_call = {"role": "assistant", "content": [{"type": "text", "text": "Adding."}, {
        "type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}}]}
    assert [i.model_dump(exclude_defaults=True) for i in message_items(anthropic_call, {})] == [
        {"type": "message", "role": "assistant", "text": "Adding."},
        {"type": "tool_call", "text": '{"a": 2}', "tool_call_id": "toolu_1", "name": "add"}]
    long = message_items({"role": "tool", "tool_call_id": "x", "content": "y" * 5000}, {})[0]
    assert (long.type, len(long.text), long.truncated, long.name) == ("tool_result", 2000, True, None)
    parts = message_items({"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url"}]}, {})
    assert [(i.type, i.text) for i in parts] == [("message", "see\n[image_url]")]


def test_the_session_json_carries_tool_calls_and_tool_results_as_items(tool_gateway: RunningGateway) -> None:
    """What the console's call tree draws: the first call's reply calls a tool, the second call sends the
    tool's result; each is its own item, not only prompt tokens."""
    client = OpenAI(base_url=tool_gateway.v1("tool-items"), api_key="unused", max_retries=0)
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="tool-tiny", messages=history, tools=[ADD_TOOL], temperature=0)
    reply = first.choices[0].message
    assert reply.tool_calls, "the tool model calls its tool"
    call_id = reply.tool_calls[0].id
    history += [reply.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call_id, "content": "5"}]
    client.chat.completions.create(model="tool-tiny", messages=history, tools=[ADD_TOOL], temperature=0)

    calls = _get(tool_gateway, "/v1/sessions/tool-items").json()["calls"]
    assert [c["link"] for c in calls] == ["start", "extend"]
    assert calls[0]["added_items"] == [{"type": "message", "role": "user", "text": QUESTION, "tool_call_id": None,
                                        "name": None, "truncated": False}]
    (tool_call,) = calls[0]["reply_items"]
    assert (tool_call["type"], tool_call["name"], tool_call["tool_call_id"]) == ("tool_call", "add", call_id)
    assert json.loads(tool_call["text"]) == {"a": 2, "b": 3}
    # the second call resent the first one's reply (not repeated here) and added the tool's result
    assert calls[1]["added_items"] == [{"type": "tool_result", "role": None, "text": "5", "tool_call_id": call_id,
                                        "name": "add", "truncated": False}]
    assert [i["type"] for i in calls[1]["reply_items"]] == ["message"]
    assert calls[1]["reply_items"][0]["role"] == "assistant"


def test_capture_stats_count_chained_calls_segment_starts_and_set_asides(keyed: RunningGateway) -> None:
    client = OpenAI(base_url=keyed.v1("cap-1"), api_key="agent-a", max_retries=0)
    history: list[Any] = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2)
    history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "go on"}]
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=2)  # extends
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "edited"}], max_tokens=2)
    _call(keyed, "agent-b", f"cap-{uuid.uuid4().hex[:6]}")
    assert _post(keyed, "/v1/rewards", {"session_id": "cap-1", "reward": 1, "final": True}, AGENT_A).status_code == 200
    assert _post(keyed, "/v1/sessions/cap-1/exclude", None, ADMIN).status_code == 200

    _error(_get(keyed, "/v1/stats/capture", AGENT_A), 403, "admin_required")
    stats = _get(keyed, "/v1/stats/capture", ADMIN).json()
    assert stats["object"] == "capture_stats"
    by_owner = {row["owner"]: row for row in stats["data"]}
    a, b = by_owner[fingerprint("agent-a")], by_owner[fingerprint("agent-b")]
    assert (a["model"], a["calls"], a["chained"], a["chained_share"]) == (MODEL, 3, 1, 0.5)
    assert a["segment_starts"] == {"start": 1, "prefix_changed": 1} and a["set_aside"] == {"excluded": 1}
    assert (b["calls"], b["chained"], b["chained_share"], b["segment_starts"]) == (1, 0, None, {"start": 1})
    total = stats["total"]
    assert (total["calls"], total["chained"], total["chained_share"]) == (4, 1, 0.5)
    assert total["segment_starts"] == {"prefix_changed": 1, "start": 2} and total["set_aside"] == {"excluded": 1}


def test_the_policies_listing_explains_sessions_piling_up_as_stale(keyed: RunningGateway) -> None:
    """Late rewards at the default staleness bound: the listing says, in words, why sessions go unused and
    which setting lets the trainer use them; a few stale sessions beside much training say nothing."""
    with Session(keyed.gateway.db) as s:
        for i in range(40):
            add_session(s, f"late-{i}", f"g-{i // 8}", float(i % 2), version=0)
        s.commit()
        assert leases.set_aside_stale(s, min_version=1) == 40  # the trainer has moved on 2 versions
    hints = _get(keyed, "/v1/policies", ADMIN).json()["hints"]
    assert len(hints) == 1
    assert hints[0].startswith("40 finished sessions were set aside as stale, against 0 trained on")
    assert "train.max_staleness (1)" in hints[0]
    assert _get(keyed, "/v1/policies", ADMIN, policy="default").json()["hints"] == hints

