"""Two gateway processes on one store (SQLite file or PostgreSQL), as several gateway hosts run: a
session whose turns alternate between them is one trajectory, racing forks are told apart by the
store, an idempotent reward posted to both at once is stored once, and a trainer's hold placed through
one stops generation in the other. Real `tracetrain serve` processes, each with its own in-process
engine on the same tiny model.

One pair of processes per store serves every test of this module: each test uses its own session ids,
and the hold test releases its hold before it ends, so none sees another's state."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from tests.integration.test_durability import _spawn_gateway, _wait_for_gateway
from tests.support.servers import PostgresCluster, free_port
from tracetrain.store.db import connect_db, open_db
from tracetrain.store.models import Call, Reward

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store per backend for the whole module (the conftest's `db_url` is a fresh one per test)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('processes') / 'store.db'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    return cluster.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module")
def two_gateways(tiny_model_path: Path, db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two `tracetrain serve` processes on the store, started once per store and side by side: starting
    a pair is most of what these tests would otherwise spend. The store gets its tables first, so that
    neither process finds the other's migration half done."""
    tmp_path = tmp_path_factory.mktemp("gateways")
    open_db(db_url).dispose()
    processes: list[subprocess.Popen[bytes]] = []
    ports, logs = [free_port(), free_port()], [tmp_path / "gateway-a.log", tmp_path / "gateway-b.log"]
    try:
        for port, log in zip(ports, logs, strict=True):
            processes.append(_spawn_gateway(tiny_model_path, db_url, port, log))
        for process, port, log in zip(processes, ports, logs, strict=True):
            _wait_for_gateway(process, port, log)
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def chat(url: str, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = httpx.post(f"{url}/s/{session}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 1.0})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def calls(db_url: str, session: str) -> list[Call]:
    with Session(connect_db(db_url)) as db:
        return list(db.exec(select(Call).where(Call.session_id == session).order_by(Call.seq)).all())  # type: ignore[arg-type]


def test_a_session_alternating_between_processes_is_one_trajectory(two_gateways: list[str], db_url: str) -> None:
    messages: list[dict[str, Any]] = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"step {turn}"})
        reply = chat(two_gateways[turn % 2], "alternating", messages)["choices"][0]["message"]
        messages.append({"role": "assistant", "content": reply["content"]})
    stored = calls(db_url, "alternating")
    assert [c.seq for c in stored] == list(range(6))
    assert [c.link for c in stored] == ["start"] + ["extend"] * 5
    for url in two_gateways:  # either process reads back the same single segment
        (trajectory,) = httpx.get(f"{url}/v1/sessions/alternating/trajectory", timeout=30).json()["trajectories"]
        assert len(trajectory["segments"]) == 1


def test_racing_forks_of_one_call_are_an_extend_and_a_branch(two_gateways: list[str], db_url: str) -> None:
    first = [{"role": "user", "content": "begin"}]
    reply = chat(two_gateways[0], "fork", first)["choices"][0]["message"]
    history = [*first, {"role": "assistant", "content": reply["content"]}]
    barrier = threading.Barrier(2)

    def fork(i: int) -> None:
        barrier.wait()
        chat(two_gateways[i], "fork", [*history, {"role": "user", "content": f"option {i}"}])

    threads = [threading.Thread(target=fork, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    start, *forks = calls(db_url, "fork")
    assert sorted(c.link for c in forks) == ["branch", "extend"]
    assert {c.parent_id for c in forks} == {start.id}
    assert sorted(c.seq for c in forks) == [1, 2]


def post_together(urls: list[str], body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST the same reward to every URL at the same moment."""
    barrier = threading.Barrier(len(urls))
    answers: list[dict[str, Any]] = []

    def post(url: str) -> None:
        barrier.wait()
        response = httpx.post(f"{url}/v1/rewards", json=body, timeout=30)
        assert response.status_code == 200, response.text
        answers.append(response.json())

    threads = [threading.Thread(target=post, args=(url,)) for url in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return answers


def test_an_idempotent_reward_posted_to_both_at_once_is_stored_once(two_gateways: list[str], db_url: str) -> None:
    chat(two_gateways[0], "rewarded", [{"role": "user", "content": "hello"}])
    for attempt in range(5):
        answers = post_together(two_gateways, {"session_id": "rewarded", "reward": 1.0,
                                               "idempotency_key": f"grader-{attempt}"})
        assert sorted(a["duplicate"] for a in answers) == [False, True]
        assert answers[0]["id"] == answers[1]["id"]
    with Session(connect_db(db_url)) as db:
        assert len(db.exec(select(Reward).where(Reward.session_id == "rewarded")).all()) == 5


def test_a_hold_placed_through_one_process_stops_the_other(two_gateways: list[str]) -> None:
    holder, other = two_gateways
    response = httpx.post(f"{holder}/v1/generation/hold", json={"holder": "trainer", "ttl_s": 60}, timeout=30)
    assert response.status_code == 200
    time.sleep(1.0)  # the other process mirrors the store's holds every 0.25 s
    assert httpx.get(f"{other}/v1/generation", timeout=30).json() == {"open": False, "holders": ["remote:trainer"]}
    done: list[float] = []
    thread = threading.Thread(target=lambda: (chat(other, "held", [{"role": "user", "content": "hi"}]),
                                              done.append(time.monotonic())))
    thread.start()
    time.sleep(1.5)
    assert not done  # held, not refused
    released = time.monotonic()
    assert httpx.post(f"{holder}/v1/generation/release", json={"holder": "trainer"}, timeout=30).status_code == 200
    thread.join(timeout=60)
    assert done and done[0] >= released
