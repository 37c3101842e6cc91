"""Staleness-aware admission over real HTTP: new sessions are held while the trainer has a batch's
worth of work ready or running, refused with 429 + Retry-After in OpenAI's error shape after the wait,
and let through as soon as a trainer (in any process: the store is what counts) claims a batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.config import TrainConfig
from tracetrain.store import leases
from tracetrain.store.db import open_db


@pytest.fixture
def admitting(tiny_engine: Any, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'adm.db'}",
                            gateway={"admission": "staleness", "admission_wait_s": 1.0},
                            train=TrainConfig(batch_sessions=2, min_sessions=1))
    yield running
    running.stop()


def _ask(gw: RunningGateway, session: str, group: str | None = None, **headers: str) -> Any:
    client = OpenAI(base_url=gw.v1(session, group), api_key="unused", max_retries=0, default_headers=headers)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def _finish(gw: RunningGateway, *sessions: str) -> None:
    for session in sessions:
        posted = httpx.post(f"{gw.url}/v1/rewards", json={"session_id": session, "reward": 1.0, "final": True})
        posted.raise_for_status()


def test_new_sessions_wait_for_the_trainer_and_running_ones_never_do(admitting: RunningGateway) -> None:
    gw = admitting
    _ask(gw, "s1", "ga")
    _ask(gw, "s2", "gb")  # two running sessions fill the limit (1 batch of 2)

    began = time.monotonic()
    with pytest.raises(openai.RateLimitError) as refused:
        _ask(gw, "s3", "gc")
    assert time.monotonic() - began >= 1.0, "held for gateway.admission_wait_s before refusing"
    assert refused.value.status_code == 429
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.response.json()["error"]["code"] == "admission_full"

    _ask(gw, "s1")  # a running session's next call is never held
    _ask(gw, "s1-sibling", "ga")  # nor a sibling of a group admitted moments ago
    _ask(gw, "eval-1", **{"X-Admission": "bypass"})  # nor evaluation traffic

    _finish(gw, "s1", "s2", "s1-sibling")  # ready for the trainer now, still a batch's worth of work
    with pytest.raises(openai.RateLimitError):
        _ask(gw, "s3", "gc")

    gw.gateway.admission.wait_s = 30.0
    answered: list[float] = []
    held = threading.Thread(target=lambda: (_ask(gw, "s3", "gc"), answered.append(time.monotonic())))
    held.start()
    time.sleep(1.0)
    assert held.is_alive(), "held while the trainer has not claimed anything"
    # A trainer in another process claims through the store; the gateway sees it on its next look.
    with Session(open_db(gw.gateway.config.store.url)) as db:
        claimed_at = time.monotonic()
        assert len(leases.claim_groups(db, trainer_id="elsewhere", want=2, lease_s=60, min_version=None,
                                       settle_s=30)) >= 2
    held.join(timeout=10)
    assert answered and answered[0] - claimed_at < 2.0, "the held session started once the batch was claimed"


@pytest.fixture
def admitting_policies(tiny_engine: Any, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'adm-policies.db'}",
                            gateway={"admission": "staleness", "admission_wait_s": 1.0, "admission_batches": 1.0,
                                     "policies": [{"name": "busy"},
                                                  {"name": "quiet", "settings": {"batch_sessions": 3}}]},
                            train=TrainConfig(batch_sessions=2, min_sessions=1))
    yield running
    running.stop()


def _ask_policy(gw: RunningGateway, policy: str, session: str) -> Any:
    client = OpenAI(base_url=f"{gw.url}/p/{policy}/s/{session}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_each_policy_is_admitted_against_its_own_limit(admitting_policies: RunningGateway) -> None:
    gw = admitting_policies
    _ask_policy(gw, "busy", "b1")
    _ask_policy(gw, "busy", "b2")  # busy's limit: one batch of the config's 2
    with pytest.raises(openai.RateLimitError) as refused:
        _ask_policy(gw, "busy", "b3")
    assert refused.value.response.json()["error"]["code"] == "admission_full"
    assert "of policy 'busy'" in refused.value.response.json()["error"]["message"]

    # A full busy policy holds no other policy's agents: a request held for busy's room would wait out
    # admission_wait_s and be refused, since nothing frees it here (each call below raises if refused).
    for session in ("q1", "q2", "q3"):
        _ask_policy(gw, "quiet", session)
    _ask(gw, "d1", "gd")  # nor the default policy's
    with pytest.raises(openai.RateLimitError):  # quiet's own limit: one batch of its own batch_sessions, 3
        _ask_policy(gw, "quiet", "q4")

    _finish(gw, "q1", "q2", "q3")  # final and ready: still quiet's work, until a trainer claims it
    with pytest.raises(openai.RateLimitError):
        _ask_policy(gw, "quiet", "q5")
    with Session(open_db(gw.gateway.config.store.url)) as db:
        assert leases.ready_count(db, policy="quiet") == 3 and leases.ready_count(db, policy="busy") == 0
        claimed = leases.claim_groups(db, trainer_id="elsewhere", want=3, lease_s=60, min_version=None,
                                      settle_s=0, policy="quiet")
    assert len(claimed) == 3
    _ask_policy(gw, "quiet", "q5")  # the trainer took quiet's batch: room for quiet again
    with pytest.raises(openai.RateLimitError):  # and none for busy, whose sessions still run
        _ask_policy(gw, "busy", "b4")
