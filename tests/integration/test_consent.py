"""Sessions not for training, by the key's setting, the request's `X-Train: no` or an admin's word: served and
kept, never claimed by a trainer or exported, counted by reason among the set-aside sessions, and no one can
include them again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.config import Config
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.store import leases

AGENT, SHY, ADMIN = "agent-key", "no-train-key", "admin-key"


@pytest.fixture
def keyed(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    # Wrapped: the gateway closes its engine when it stops, and the module's engine serves the next test.
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'gw.db'}",
                            gateway={"api_keys": [AGENT, {"key": SHY, "train": False}], "admin_key": ADMIN})
    yield running
    running.stop()


def _ask(gw: RunningGateway, session: str, key: str, **headers: str) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{gw.v1(session)}/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}", **headers})


def _admin(gw: RunningGateway, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{gw.url}{path}", headers={"Authorization": f"Bearer {ADMIN}"}, **kwargs)


def _finish(gw: RunningGateway, session: str, key: str) -> None:
    reward = httpx.post(f"{gw.url}/v1/rewards", json={"session_id": session, "reward": 1.0, "final": True},
                        headers={"Authorization": f"Bearer {key}"})
    assert reward.status_code == 200, reward.text


def test_sessions_not_for_training_are_served_kept_and_never_trained_or_exported(keyed: RunningGateway) -> None:
    assert _ask(keyed, "by-key", SHY).status_code == 200
    assert _ask(keyed, "by-header", AGENT, **{"X-Train": "no"}).status_code == 200
    assert _ask(keyed, "later", AGENT).status_code == 200
    assert _ask(keyed, "later", AGENT, **{"X-Train": "no"}).status_code == 200  # consent withdrawn mid-session
    assert _ask(keyed, "by-admin", AGENT).status_code == 200
    assert _ask(keyed, "trained", AGENT).status_code == 200
    marked = _admin(keyed, "POST", "/v1/sessions/by-admin/no_train", json={"note": "user asked"})
    assert marked.status_code == 200 and marked.json()["action"]["action"] == "no_train"
    for session, key in [("by-key", SHY), ("by-header", AGENT), ("later", AGENT), ("by-admin", AGENT),
                         ("trained", AGENT)]:
        _finish(keyed, session, key)

    reasons = {s: _admin(keyed, "GET", f"/v1/sessions/{s}").json()["skip_reason"]
               for s in ("by-key", "by-header", "later", "by-admin", "trained")}
    assert reasons == {"by-key": "no_train_key", "by-header": "no_train_header", "later": "no_train_header",
                       "by-admin": "no_train_admin", "trained": None}
    assert len(_admin(keyed, "GET", "/v1/sessions/later").json()["calls"]) == 2, "kept for audit"
    set_aside = _admin(keyed, "GET", "/v1/policies").json()["sessions"]["set_aside"]
    assert set_aside == {"no_train_key": 1, "no_train_header": 2, "no_train_admin": 1}
    exported = [line for line in _admin(keyed, "GET", "/v1/export").text.splitlines() if line]
    assert exported and all('"session_id":"trained"' in line for line in exported)
    with Session(keyed.gateway.db) as db:
        assert leases.ready_count(db) == 1  # only "trained" is there for a trainer to claim


def test_no_one_includes_a_session_not_for_training_again(keyed: RunningGateway) -> None:
    assert _ask(keyed, "shy", SHY).status_code == 200
    included = _admin(keyed, "POST", "/v1/sessions/shy/include")
    assert included.status_code == 409 and included.json()["error"]["code"] == "not_for_training"
    again = _admin(keyed, "POST", "/v1/sessions/shy/no_train")
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_for_training"
    assert _admin(keyed, "POST", "/v1/sessions/none/no_train").status_code == 404
    assert httpx.post(f"{keyed.url}/v1/sessions/shy/no_train",
                      headers={"Authorization": f"Bearer {AGENT}"}).status_code == 403
    actions = _admin(keyed, "GET", "/v1/sessions/shy/actions").json()["data"]
    assert [(a["action"], a["new_value"]) for a in actions] == [
        ("no_train", {"excluded": True, "skip_reason": "no_train_key"})]


def test_a_bad_x_train_header_is_refused_and_records_nothing(keyed: RunningGateway) -> None:
    refused = _ask(keyed, "bad-header", AGENT, **{"X-Train": "maybe"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_x_train"
    assert _admin(keyed, "GET", "/v1/sessions/bad-header").status_code == 404
    assert _ask(keyed, "yes-header", AGENT, **{"X-Train": "yes"}).status_code == 200
    assert _admin(keyed, "GET", "/v1/sessions/yes-header").json()["skip_reason"] is None


@pytest.mark.parametrize("entry", [{"key": ""}, {"key": "k", "train": "perhaps"}, {"key": "k", "trian": False},
                                   {"train": False}])
def test_a_bad_key_entry_is_refused_when_the_config_loads(entry: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Config.model_validate({"gateway": {"api_keys": [entry]}})


def test_key_entries_may_be_strings_or_objects() -> None:
    config = Config.model_validate({"gateway": {"api_keys": ["a", {"key": "b", "train": False}, {"key": "c"}]}})
    assert config.gateway.agent_keys() == ["a", "b", "c"] and config.gateway.untrained_keys() == ["b"]
