"""Faults, each a test (issue 14): real processes, nothing mocked.

* PostgreSQL restarted under load: calls and rewards during the outage get a 503 in OpenAI's error
  shape at once (no hang), the gateway's pool reconnects by itself, and everything it acknowledged
  is in the store.
* The SQLite store's disk fills up under load: calls get a 503 `store_full` and are not answered 200
  unstored; once space is back the same gateway process stores again, and nothing acknowledged
  before is lost.
* A trainer process SIGKILLed while it holds a lease, and another while a step it recorded is being
  published: the leases lapse, the next trainer resumes from the latest recorded checkpoint, and every
  session is trained exactly once.
* The only vLLM server (started by `tracetrain serve` itself) SIGKILLed under load: calls get 502/503
  in OpenAI's error shape, the gateway starts vLLM again and serves without being restarted itself.

What "acknowledged" means here (docs/architecture.md, decision 6): the gateway answers a call (a non-streamed
200, or a stream's final chunk with a finish_reason) and a reward (200 with its id) only after the
record is committed. Each test counts what the client saw and checks that every acknowledged id is in
the store afterwards; each prints a one-line summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlmodel import Session, select

from tests.integration.test_durability import _start_gateway
from tests.support.servers import PostgresCluster, free_port
from tests.support.sessions import add_session
from tests.support.setup_steps import POSTGRES_MISSING, VLLM_MISSING
from tracetrain.store.db import connect_db, open_db
from tracetrain.store.models import AgentSession, Call, Policy, Reward

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

MAX_WAIT_S = 20.0
"""No request may take longer than this while the store is away: a clear error, not a hang."""


# --- load: agents making calls and posting rewards, and what they saw --------------------------------------------


@dataclass
class Seen:
    """One request as the client saw it."""

    what: str
    """`plain` or `stream` (a chat call), `reward`."""
    status: int
    """HTTP status; for a stream 200 only once its final chunk arrived, else its error event's status;
    0 when the connection failed or the stream was cut without an error event."""
    ident: str = ""
    """Acknowledged: the completion id of a call, the id of a reward."""
    code: str = ""
    """A refusal's error code (OpenAI shape: {"error": {"message", "type", "code", "param"}})."""
    shaped: bool = True
    """A refusal came in OpenAI's error shape."""
    mid_stream: bool = False
    """The refusal was an error event in a stream already answered 200 (generated, then not stored)."""
    seconds: float = 0.0
    at: float = 0.0


@dataclass
class Load:
    """Agents making one-call sessions (half of them streamed) and, apart from them, a client posting
    each answered session's final reward `score_after_s` later, as an application that scores its
    agents' work afterwards does. A refused reward goes back in the queue and is sent again with the
    same idempotency key."""

    base: str
    model: str
    workers: int = 8
    reward_workers: int = 2
    max_tokens: int = 4
    score_after_s: float = 1.0
    pause_after_refusal_s: float = 0.05
    """A refusal comes at once: an agent waits this long before its next call rather than spin."""
    seen: list[Seen] = field(default_factory=list)
    unrewarded: list[tuple[float, str]] = field(default_factory=list)
    """(answered at, session), oldest first."""

    def answered(self, *whats: str) -> set[str]:
        return {s.ident for s in self.seen if s.status == 200 and s.what in whats}

    def calls_ok(self, since: float = 0.0) -> int:
        return sum(1 for s in self.seen if s.at >= since and s.status == 200 and s.what != "reward")

    def refused(self, since: float = 0.0, what: str | None = None) -> list[Seen]:
        return [s for s in self.seen if s.status != 200 and s.at >= since and what in (None, s.what)]

    def summary(self) -> str:
        by = Counter((s.what, s.status) for s in self.seen)
        return ", ".join(f"{what} {status}: {n}" for (what, status), n in sorted(by.items()))

    async def run(self, stop: asyncio.Event) -> None:
        async def agent(w: int) -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                turn = 0
                while not stop.is_set():
                    session = f"f-{w}-{turn}-{uuid.uuid4().hex[:6]}"
                    what = "stream" if w % 2 else "plain"
                    body = {"model": self.model, "max_tokens": self.max_tokens,
                            "messages": [{"role": "user", "content": f"worker {w} turn {turn}"}]}
                    seen = await self._call(client, f"{self.base}/s/{session}/v1/chat/completions", body, what)
                    self.seen.append(seen)
                    if seen.status == 200:
                        self.unrewarded.append((seen.at, session))
                    else:
                        await asyncio.sleep(self.pause_after_refusal_s)
                    turn += 1

        calls_over = asyncio.Event()

        async def scorer() -> None:  # goes on after the agents stop until every answered session is scored
            async with httpx.AsyncClient(timeout=60) as client:
                while not calls_over.is_set() or self.unrewarded:
                    if not self.unrewarded or self.unrewarded[0][0] > time.monotonic() - self.score_after_s:
                        await asyncio.sleep(0.02)
                        continue
                    answered_at, session = self.unrewarded.pop(0)
                    seen = await self._reward(client, session)
                    self.seen.append(seen)
                    if seen.status != 200:
                        self.unrewarded.append((answered_at, session))
                        await asyncio.sleep(self.pause_after_refusal_s)

        async def agents() -> None:
            await asyncio.gather(*(agent(w) for w in range(self.workers)))
            calls_over.set()

        await asyncio.gather(agents(), *(scorer() for _ in range(self.reward_workers)))

    async def _call(self, client: httpx.AsyncClient, url: str, body: dict[str, Any], what: str) -> Seen:
        started = time.monotonic()
        try:
            if what == "plain":
                response = await client.post(url, json=body)
                seen = _refusal(response, what)
                if response.status_code == 200:
                    seen.ident = response.json()["id"]
            else:
                seen = await _stream(client, url, body)
        except httpx.HTTPError as exc:
            seen = Seen(what, 0, code=type(exc).__name__)
        seen.seconds, seen.at = time.monotonic() - started, time.monotonic()
        return seen

    async def _reward(self, client: httpx.AsyncClient, session: str) -> Seen:
        started = time.monotonic()
        try:
            response = await client.post(f"{self.base}/v1/rewards", json={
                "session_id": session, "reward": 1.0, "final": True, "idempotency_key": f"score-{session}"})
            seen = _refusal(response, "reward")
            if response.status_code == 200:
                seen.ident = str(response.json()["id"])
        except httpx.HTTPError as exc:
            seen = Seen("reward", 0, code=type(exc).__name__)
        seen.seconds, seen.at = time.monotonic() - started, time.monotonic()
        return seen


def _shaped(body: Any) -> tuple[bool, str]:
    """Whether `body` is OpenAI's error shape for a server error, and its code."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return False, ""
    ok = {"message", "type", "code", "param"} <= error.keys() and bool(error["message"]) \
        and error["type"] == "server_error"
    return ok, str(error.get("code"))


def _refusal(response: httpx.Response, what: str) -> Seen:
    if response.status_code == 200:
        return Seen(what, 200)
    try:
        shaped, code = _shaped(response.json())
    except ValueError:
        shaped, code = False, response.text[:80]
    return Seen(what, response.status_code, code=code, shaped=shaped)


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Seen:
    """A stream is acknowledged by its final chunk (a choice with a finish_reason): the gateway sends
    it only after the call is committed. An error event ends it with that error's status."""
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return _refusal(response, "stream")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                shaped, code = _shaped(chunk)
                # An error event carries no status: the one the same error gets before a stream starts.
                status = {"store_unavailable": 503, "store_full": 503, "engine_unavailable": 503,
                          "engine_timeout": 504, "engine_busy": 429}.get(code, 502)
                return Seen("stream", status, code=code, shaped=shaped, mid_stream=True)
            if any(c.get("finish_reason") for c in chunk["choices"]):
                return Seen("stream", 200, ident=chunk["id"])
    return Seen("stream", 0, code="cut")  # ended without its final chunk or an error event


async def wait_for(check: Any, timeout: float, what: str, load: asyncio.Task[None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        if load is not None and load.done():
            load.result()
            raise AssertionError(f"the load stopped while waiting for {what}")
        await asyncio.sleep(0.05)


def stored(db_url: str) -> tuple[set[str], set[str]]:
    """(completion ids of stored calls, ids of stored rewards)."""
    db = connect_db(db_url)
    try:
        with Session(db) as s:
            return set(s.exec(select(Call.completion_id)).all()), {str(i) for i in s.exec(select(Reward.id)).all()}
    finally:
        db.dispose()


def losses(load: Load, db_url: str) -> tuple[set[str], set[str], set[str], set[str]]:
    """(answered calls, acknowledged rewards, and of each those the store does not hold)."""
    calls, rewards = stored(db_url)
    answered, acknowledged = load.answered("plain", "stream"), load.answered("reward")
    return answered, acknowledged, answered - calls, acknowledged - rewards


def _stop_gateway(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- 1. PostgreSQL restarted under load -----------------------------------------------------------------------


def _pg_ctl(cluster: PostgresCluster, *args: str) -> None:
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*as_postgres, str(cluster.bin("pg_ctl")), "-D", str(cluster.dir / "data"), *args],
                   check=True, capture_output=True)


@pytest.fixture
def restartable_postgres() -> Iterator[PostgresCluster]:
    """A cluster of its own, with production durability: this test stops and starts it."""
    if not PostgresCluster.available():
        pytest.skip(POSTGRES_MISSING)
    cluster = PostgresCluster(durable=True)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.postgres
async def test_postgres_restarted_under_load(tiny_model_path: Path, restartable_postgres: PostgresCluster,
                                             tmp_path: Path) -> None:
    cluster = restartable_postgres
    db_url = cluster.create_database("faults")
    log = tmp_path / "gateway.log"
    port = free_port()
    gateway = _start_gateway(tiny_model_path, db_url, port, log)
    load = Load(f"http://127.0.0.1:{port}", "tiny")
    stop = asyncio.Event()
    running = asyncio.create_task(load.run(stop))
    try:
        await wait_for(lambda: load.calls_ok() >= 30, 120, "30 answered calls before the restart", running)
        down_at = time.monotonic()
        _pg_ctl(cluster, "-m", "fast", "-w", "stop")  # disconnects every session, as a restart does
        await wait_for(lambda: len(load.refused(down_at, "reward")) >= 5 and len(load.refused(down_at)) >= 20, 30,
                       "calls and rewards refused while PostgreSQL is down", running)
        await asyncio.sleep(2)  # an outage of a few seconds, under load
        settings = "-c fsync=on -c synchronous_commit=on -c full_page_writes=on"
        _pg_ctl(cluster, "-w", "-l", str(cluster.dir / "log"), "-o",
                f"-p {cluster.port} -k {cluster.dir} {settings}", "start")
        up_at = time.monotonic()
        await wait_for(lambda: load.calls_ok(since=up_at) >= 30, 120, "30 answered calls after the restart", running)
    finally:
        stop.set()
        await asyncio.wait_for(running, 120)
    alive = gateway.poll() is None
    _stop_gateway(gateway)

    answered, acknowledged, lost_calls, lost_rewards = losses(load, db_url)
    refused = load.refused()
    print(f"\nPostgreSQL restart: the client saw {load.summary()} (refusals: "
          f"{dict(Counter(s.code for s in refused))}, {sum(s.mid_stream for s in refused)} of them as a stream's "
          f"error event); slowest request {max(s.seconds for s in load.seen):.1f} s; "
          f"{load.calls_ok(since=up_at)} calls answered after the restart by the same gateway process; lost "
          f"{len(lost_calls)} of {len(answered)} answered calls and {len(lost_rewards)} of {len(acknowledged)} "
          "acknowledged rewards")
    assert alive, "the gateway process died: " + log.read_text()[-3000:]
    assert not lost_calls and not lost_rewards
    assert {s.status for s in refused} == {503}, load.summary()  # no 500, no cut connection
    assert all(s.shaped and s.code == "store_unavailable" for s in refused), [vars(s) for s in refused[:5]]
    assert all(s.at >= down_at for s in refused)
    assert max(s.seconds for s in load.seen) < MAX_WAIT_S
    assert len(acknowledged) == len(answered)  # every refused reward was sent again and got through


# --- 2. The store's disk fills up ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of its own, so the test can fill it without touching anything else."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("the disk-full test mounts a small tmpfs: it needs root and mount(8)")
    mountpoint = tmp_path / "small-disk"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"the disk-full test mounts a small tmpfs, and mount failed here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def fill(path: Path) -> int:
    """Write `path` until the disk is full; returns the bytes written."""
    written = 0
    chunk = b"\0" * 65536
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk) or 0
            except OSError:
                break
    # What is left is smaller than a chunk: take that too.
    with path.open("ab", buffering=0) as f:
        for size in (4096, 512, 1):
            while True:
                try:
                    written += f.write(b"\0" * size) or 0
                except OSError:
                    break
    return written


async def test_disk_full_under_load(tiny_model_path: Path, small_disk: Path, tmp_path: Path) -> None:
    db_url = f"sqlite:///{small_disk / 'store.db'}"
    filler = small_disk / "filler"
    log = tmp_path / "gateway.log"
    port = free_port()
    gateway = _start_gateway(tiny_model_path, db_url, port, log)
    load = Load(f"http://127.0.0.1:{port}", "tiny")
    stop = asyncio.Event()
    running = asyncio.create_task(load.run(stop))
    try:
        await wait_for(lambda: load.calls_ok() >= 30, 120, "30 answered calls before the disk fills", running)
        full_at = time.monotonic()
        filled = await asyncio.to_thread(fill, filler)
        await wait_for(lambda: len(load.refused(full_at)) >= 20, 60, "refusals once the disk is full", running)
        answered_while_full = load.calls_ok(since=full_at)
        freed_at = time.monotonic()
        filler.unlink()
        await wait_for(lambda: load.calls_ok(since=freed_at) >= 30, 120, "30 answered calls once space is back",
                       running)
    finally:
        stop.set()
        await asyncio.wait_for(running, 120)
    alive = gateway.poll() is None
    _stop_gateway(gateway)

    check = connect_db(db_url)
    with check.connect() as conn:
        integrity = conn.execute(text("PRAGMA integrity_check")).scalar()
    check.dispose()
    answered, acknowledged, lost_calls, lost_rewards = losses(load, db_url)
    refused = load.refused()
    print(f"\ndisk full: filled the last {filled // 1024} KiB of an 8 MiB tmpfs; the client saw {load.summary()} "
          f"(refusals: {dict(Counter(s.code for s in refused))}, {sum(s.mid_stream for s in refused)} of them as a "
          f"stream's error event; {answered_while_full} calls still answered, and stored, while full); "
          f"{load.calls_ok(since=freed_at)} calls answered after the filler was deleted, by the same gateway "
          f"process; lost {len(lost_calls)} of {len(answered)} answered calls and {len(lost_rewards)} of "
          f"{len(acknowledged)} acknowledged rewards; integrity_check: {integrity}")
    assert alive, "the gateway process died: " + log.read_text()[-3000:]
    assert not lost_calls and not lost_rewards
    assert integrity == "ok"
    assert {s.status for s in refused} == {503}, load.summary()
    assert all(s.shaped and s.code == "store_full" for s in refused), [vars(s) for s in refused[:5]]
    assert all(full_at <= s.at for s in refused)
    assert max(s.seconds for s in load.seen) < MAX_WAIT_S
    assert len(acknowledged) == len(answered)


# --- 3. A trainer process killed mid-step ---------------------------------------------------------------------

LEASE_S = 4.0
"""The trainers' lease (and, in sync mode, their generation hold): short, so a dead trainer's lapses soon."""


class StandInGateway:
    """The gateway's admin endpoints a `tracetrain train --gateway-url` process calls (generation hold and
    release, `POST /v1/policies`), answered 200, except that requests to a path in `block` wait until
    `release` is set: a trainer sending one sits at a known point of its step, where the test kills it."""

    def __init__(self) -> None:
        self.requests: list[tuple[float, str, dict[str, Any]]] = []
        self.block: set[str] = set()
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                outer.requests.append((time.monotonic(), self.path, body))
                if self.path in outer.block:
                    outer.release.wait(120)
                payload = b'{"ok": true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def seen(self, path: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, body) for t, p, body in self.requests if p == path]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


def start_trainer(model: Path, db_url: str, gateway_url: str, checkpoints: Path, log: Path) -> subprocess.Popen[bytes]:
    """`tracetrain train` as its own process: sync mode (it holds the gateway's generation while it steps,
    which gives the test a request to wait on between claiming a batch and training it), full weights,
    8 sessions a step, a short lease."""
    settings = {"train.mode": "sync", "train.lora": "false", "train.lr": "1e-3", "train.batch_sessions": "8",
                "train.min_sessions": "8", "train.lease_s": str(LEASE_S), "train.poll_s": "0.25",
                "train.max_staleness": "100", "train.checkpoint_dir": str(checkpoints), "gateway.log_level": "INFO"}
    command = [sys.executable, "-m", "tracetrain.cli", "train", "--db-url", db_url, "--model", str(model),
               "--gateway-url", gateway_url]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_until(check: Any, timeout: float, what: str, process: subprocess.Popen[bytes] | None = None,
               log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the trainer exited ({process.returncode}) while waiting for {what}:\n"
                                 + (log.read_text()[-3000:] if log else ""))
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                                 + (f":\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(0.1)


def _kill(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def add_groups(db_url: str, first: int, count: int) -> list[str]:
    """`count` finished sessions in groups of two, one rewarded 1 and one 0 (a signal for rloo)."""
    ids = [f"s{i:02d}" for i in range(first, first + count)]
    db = open_db(db_url)
    with Session(db) as s:
        for i, sid in enumerate(ids):
            add_session(s, sid, f"g{(first + i) // 2}", float(i % 2))
        s.commit()
    db.dispose()
    return ids


def sessions_state(db_url: str) -> dict[str, tuple[int | None, str | None]]:
    """Session id -> (trained version, lease owner)."""
    db = connect_db(db_url)
    with Session(db) as s:
        rows = {a.id: (a.trained_version, a.lease_owner) for a in s.exec(select(AgentSession)).all()}
    db.dispose()
    return rows


def policies(db_url: str) -> dict[int, Policy]:
    db = connect_db(db_url)
    with Session(db) as s:
        rows = {p.version: p for p in s.exec(select(Policy)).all()}
    db.dispose()
    return rows


def test_trainer_killed_mid_step(tiny_model_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    checkpoints = tmp_path / "checkpoints"
    first = add_groups(db_url, 0, 8)
    gateway = StandInGateway()
    trainers: list[subprocess.Popen[bytes]] = []
    try:
        # A claims the 8 sessions and is killed while it asks the gateway to hold generation: holding
        # the lease, nothing trained yet.
        gateway.block = {"/v1/generation/hold"}
        log_a = tmp_path / "trainer-a.log"
        trainers.append(a := start_trainer(tiny_model_path, db_url, gateway.url, checkpoints, log_a))
        wait_until(lambda: gateway.seen("/v1/generation/hold"), 120, "trainer A to claim a batch", a, log_a)
        held = sessions_state(db_url)
        _kill(a)
        killed_a = time.monotonic()
        owners_a = {owner for _, owner in held.values()}
        assert len(owners_a) == 1 and None not in owners_a, held  # every session leased, by A
        assert set(policies(db_url)) == {0}

        # B waits for A's lease to lapse, claims the same sessions, trains version 1, records it and is
        # killed while the gateway is taking the new version (after the step's record, before it returns).
        gateway.block = {"/v1/policies"}
        log_b = tmp_path / "trainer-b.log"
        trainers.append(b := start_trainer(tiny_model_path, db_url, gateway.url, checkpoints, log_b))
        wait_until(lambda: gateway.seen("/v1/policies"), 120, "trainer B to publish version 1", b, log_b)
        _kill(b)
        holds = gateway.seen("/v1/generation/hold")
        assert len(holds) == 2 and holds[1][0] >= killed_a  # B's step began once A was gone ...
        assert policies(db_url)[1].checkpoint is not None  # ... and recorded version 1 before it died
        after_b = sessions_state(db_url)

        # C starts with 8 more sessions in the store; it resumes from version 1 and trains what is left.
        second = add_groups(db_url, 8, 8)
        gateway.block = set()
        gateway.release.set()
        log_c = tmp_path / "trainer-c.log"
        trainers.append(c := start_trainer(tiny_model_path, db_url, gateway.url, checkpoints, log_c))
        wait_until(lambda: all(v is not None for v, _ in sessions_state(db_url).values()), 120,
                   "every session trained", c, log_c)
        time.sleep(LEASE_S + 2)  # long enough for any lease of B's to lapse and be claimed again
        _kill(c)
    finally:
        for process in trainers:
            if process.poll() is None:
                _kill(process)
        gateway.close()

    final = sessions_state(db_url)
    versions = policies(db_url)
    per_version = {v: p.metrics.get("sessions", 0) for v, p in versions.items() if v > 0}
    trained_in = Counter(v for v, _ in final.values())
    published = [body["version"] for _, body in gateway.seen("/v1/policies")]
    print(f"\ntrainer killed mid-step: A killed holding the lease on {len(held)} sessions (nothing trained); B "
          f"took them over after the lease lapsed and was killed publishing version 1 "
          f"({sum(v == 1 for v, _ in after_b.values())} of them already marked consumed by version 1); C resumed "
          f"and trained versions {sorted(per_version)[1:]}; sessions per version {per_version}, "
          f"{sum(per_version.values())} trained for {len(final)} sessions; trained by version {dict(trained_in)}; "
          f"publish requests {published}")
    # C continued version 1's checkpoint (its running totals: version 2 is the 2nd step), not the base model.
    assert versions[2].metrics["steps"] == 2 and versions[2].checkpoint is not None
    assert all(v is not None and owner is None for v, owner in final.values()), final  # none lost, no lease left
    assert sum(per_version.values()) == len(final) == 16  # none trained twice
    assert {sid for sid, (v, _) in final.items() if v == 1} == set(first)
    assert {sid for sid, (v, _) in final.items() if v != 1} == set(second)
    assert sorted(versions) == [0, 1, 2]
    assert published == [1, 2]
    assert (checkpoints / "v000002").is_dir()


# --- 4. The only vLLM server killed under load -------------------------------------------------------------------


def vllm_children(gateway: subprocess.Popen[bytes]) -> list[Any]:
    """The vLLM API servers the gateway process started (its own children, found by command line: the
    server may listen on a port or on a Unix socket)."""
    import psutil

    found = []
    for child in psutil.Process(gateway.pid).children():
        with contextlib.suppress(psutil.Error):
            if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
                found.append(child)
    return found


@pytest.mark.vllm
async def test_vllm_killed_under_load(smollm2_path: Path, tmp_path: Path) -> None:
    import psutil

    from tracetrain.engines.vllm_server import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip(VLLM_MISSING)
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    port = free_port()
    log = tmp_path / "gateway.log"
    command = [sys.executable, "-m", "tracetrain.cli", "serve", "--engine", "vllm", "--model", str(smollm2_path),
               "--served-model-name", "smollm2", "--db-url", db_url, "--port", str(port),
               "--set", "train.lora=false"]  # no LoRA slots: vLLM starts sooner and smaller
    gateway = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:  # `serve` answers once its vLLM is healthy
            assert gateway.poll() is None, f"the gateway exited:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() - started < 400, f"the gateway did not start:\n{log.read_text()[-3000:]}"
            await asyncio.sleep(1)
        first_start_s = time.monotonic() - started
        (server,) = vllm_children(gateway)
        load = Load(base, "smollm2", workers=4, max_tokens=16, pause_after_refusal_s=0.5)
        stop = asyncio.Event()
        running = asyncio.create_task(load.run(stop))
        try:
            await wait_for(lambda: load.calls_ok() >= 8, 120, "8 answered calls before the kill", running)
            tree = [server, *server.children(recursive=True)]
            for process in tree:  # the whole server, as the OOM killer or a crash would take it
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            killed_at = time.monotonic()
            await wait_for(lambda: len(load.refused(killed_at)) >= 8, 60, "refusals once vLLM is gone", running)
            await wait_for(lambda: load.calls_ok(since=killed_at) >= 8, 400,
                           "8 answered calls once the gateway has started vLLM again", running)
            back_after = min(s.at for s in load.seen if s.at >= killed_at and s.status == 200
                             and s.what != "reward") - killed_at
        finally:
            stop.set()
            await asyncio.wait_for(running, 180)
        replicas = httpx.get(f"{base}/v1/replicas", timeout=10)
        events = [e["event"] for e in replicas.json().get("events", [])] if replicas.status_code == 200 else []
        restarted = vllm_children(gateway)
        alive = gateway.poll() is None
    finally:
        _stop_gateway(gateway)

    answered, acknowledged, lost_calls, lost_rewards = losses(load, db_url)
    refused = load.refused()
    print(f"\nvLLM killed: first start {first_start_s:.0f} s; the client saw {load.summary()} (refusals: "
          f"{dict(Counter((s.status, s.code) for s in refused))}, {sum(s.mid_stream for s in refused)} of them as a "
          f"stream's error event); answered again {back_after:.0f} s after the kill, by the same gateway process "
          f"with a new vLLM (replica events {events}); lost {len(lost_calls)} of {len(answered)} answered calls "
          f"and {len(lost_rewards)} of {len(acknowledged)} acknowledged rewards")
    assert alive, "the gateway process died: " + log.read_text()[-3000:]
    assert len(restarted) == 1 and restarted[0].pid != server.pid  # started again by the gateway itself
    assert not lost_calls and not lost_rewards
    assert {s.status for s in refused} <= {502, 503}, load.summary()  # no cut connection, no 500
    assert all(s.shaped for s in refused), [vars(s) for s in refused[:5]]
    assert all(s.at >= killed_at for s in refused)
    assert all(s.what != "reward" for s in refused)  # rewards need only the store, which stayed up
    assert len(acknowledged) == len(answered)
