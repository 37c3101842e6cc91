"""`tracetrain serve --workers 2` in front of the shared vLLM server: both worker processes serve, a
LoRA version published through one of them (as `tracetrain train --gateway-url` does: POST
/v1/policies, then mark it published in the store) is served by every worker within seconds, and a
full-weight reload through one of them, under load, never lets a call record a version its weights
were not (proxy/replica_sync.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from sqlmodel import Session

from tests.integration.conftest import RunningVLLM
from tests.integration.test_publish import (
    load_model,
    save_full,
    save_lora,
)
from tests.support.servers import free_port, wait_until_healthy
from tracetrain.store.db import connect_db
from tracetrain.store.models import Policy, utcnow

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers_gateway(vllm_server: RunningVLLM, smollm2_path: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Shared by the tests below that leave its workers running: one publishes a version, the other only
    opens connections, and neither depends on what the other did (the served version does not matter to
    the spread, and nothing else publishes through it)."""
    yield from start_workers(vllm_server, smollm2_path, tmp_path_factory.mktemp("workers"), "train.lora=true",
                             "train.publish=lora")


@pytest.fixture
def own_workers_gateway(vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A gateway of the test's own, for a test that kills its workers."""
    yield from start_workers(vllm_server, smollm2_path, tmp_path, "train.lora=true", "train.publish=lora")


@pytest.fixture
def reloading_workers(vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    yield from start_workers(vllm_server, smollm2_path, tmp_path, "train.lora=false", "train.publish=reload")


def start_workers(vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path,
                  *settings: str) -> Iterator[tuple[str, str]]:
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    log = tmp_path / "gateway.log"
    command = [sys.executable, "-m", "tracetrain.cli", "serve", "--workers", "2", "--engine", "vllm",
               "--engine-url", vllm_server.url, "--model", str(smollm2_path), "--served-model-name",
               vllm_server.model_name, "--db-url", db_url, "--port", str(port)]
    for setting in settings:
        command += ["--set", setting]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log)
        yield url, db_url
    finally:
        process.terminate()
        process.wait(timeout=60)


def versions(url: str, model: str, n: int = 16, prefix: str = "") -> list[str]:
    """X-Policy-Version of `n` new sessions, each on a fresh connection (so the kernel spreads them); `prefix`
    binds them to a named policy (`/p/support`)."""
    seen = []
    for i in range(n):
        response = httpx.post(f"{url}{prefix}/v1/chat/completions", timeout=120, headers={"Connection": "close"},
                              json={"model": model, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": f"hi {i}"}]})
        assert response.status_code == 200, response.text
        seen.append(response.headers["x-policy-version"])
    return seen


def publish_through(url: str, db_url: str, policy: Policy) -> None:
    """What `tracetrain train --gateway-url` does: POST /v1/policies, then mark the version published."""
    response = httpx.post(f"{url}/v1/policies", timeout=600, json={
        "version": policy.version, "checkpoint": policy.checkpoint, "kind": policy.kind, "policy": policy.line})
    assert response.status_code == 200, response.text
    policy.published_at = utcnow()
    with Session(connect_db(db_url)) as db:
        db.add(policy)
        db.commit()


def test_a_version_published_through_one_worker_reaches_every_worker(
    workers_gateway: tuple[str, str], vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path
) -> None:
    url, db_url = workers_gateway
    assert set(versions(url, vllm_server.model_name)) == {"0"}
    adapter = save_lora(load_model(smollm2_path), tmp_path / "v1", seed=3)
    publish_through(url, db_url, Policy(version=1, checkpoint=str(adapter), kind="lora"))
    time.sleep(3)  # each worker checks the store for newer published versions every second
    assert set(versions(url, vllm_server.model_name)) == {"1"}
    served = {httpx.get(f"{url}/v1/replicas", timeout=30, headers={"Connection": "close"}).json()["served_version"]
              for _ in range(8)}
    assert served == {1}
    # A named policy's version, published through one worker, reaches every worker too.
    assert httpx.post(f"{url}/v1/policies", json={"name": "support"}, timeout=30).status_code == 200
    assert set(versions(url, vllm_server.model_name, prefix="/p/support")) == {"0"}
    support = save_lora(load_model(smollm2_path), tmp_path / "support-v1", seed=4)
    publish_through(url, db_url, Policy(line="support", version=1, checkpoint=str(support), kind="lora"))
    time.sleep(3)
    assert set(versions(url, vllm_server.model_name, prefix="/p/support")) == {"1"}
    assert set(versions(url, vllm_server.model_name, n=4)) == {"1"}, "the default line is untouched"


def test_workers_refuse_what_they_cannot_keep_consistent(tmp_path: Path) -> None:
    for extra, words in ((["--train"], "own process"),
                        (["--set", "promotion.mode=canary", "--set", "train.publish=reload"], "LoRA publishing")):
        result = subprocess.run([sys.executable, "-m", "tracetrain.cli", "serve", "--workers", "2",
                                 "--engine-url", "http://127.0.0.1:9", "--db-url", f"sqlite:///{tmp_path / 's.db'}",
                                 *extra], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and words in result.stderr, result.stderr[-2000:]


def first_token(url: str, model: str, prompt: str) -> tuple[str, float, str]:
    """Policy version, first sampled token's logprob and the text of a greedy answer on a new connection."""
    response = httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={"Connection": "close"},
                          json={"model": model, "max_tokens": 4, "temperature": 0, "logprobs": True,
                                "messages": [{"role": "user", "content": prompt}]})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprob = choice["logprobs"]["content"][0]["logprob"]
    return response.headers["x-policy-version"], logprob, choice["message"]["content"]


@pytest.mark.usefixtures("restore_base_weights")
def test_a_full_weight_reload_through_one_worker_never_mislabels_a_call_in_another(
    reloading_workers: tuple[str, str], vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path,
) -> None:
    url, db_url = reloading_workers
    model, prompt = vllm_server.model_name, "Name a colour."
    checkpoint, _ = save_full(load_model(smollm2_path), smollm2_path, tmp_path / "v1", seed=5, scale=0.05)
    version, base_logprob, _ = first_token(url, model, prompt)
    assert version == "0"
    answers: list[tuple[str, float, str]] = []
    stop = threading.Event()

    def agent() -> None:  # keeps both workers busy with calls on the one replica throughout the reload
        while not stop.is_set():
            answers.append(first_token(url, model, prompt))

    agents = [threading.Thread(target=agent) for _ in range(4)]
    for thread in agents:
        thread.start()
    try:
        time.sleep(2)
        publish_through(url, db_url, Policy(version=1, checkpoint=str(checkpoint), kind="full"))
        time.sleep(4)
    finally:
        stop.set()
        for thread in agents:
            thread.join(timeout=300)
    _, new_logprob, _ = first_token(url, model, prompt)
    assert abs(new_logprob - base_logprob) > 0.01, "the checkpoint must be told apart from the base weights"
    by_version: dict[str, list[float]] = {"0": [], "1": []}
    for label, logprob, _text in answers:
        by_version[label].append(logprob)
    assert by_version["0"] and by_version["1"], {k: len(v) for k, v in by_version.items()}
    reference = {"0": base_logprob, "1": new_logprob}
    mislabelled = [(label, lp) for label, lps in by_version.items() for lp in lps
                   if abs(lp - reference[label]) > abs(lp - reference["1" if label == "0" else "0"])]
    print(f"calls during the reload: {len(by_version['0'])} on version 0, {len(by_version['1'])} on version 1; "
          f"first-token logprob {base_logprob:.4f} -> {new_logprob:.4f}; mislabelled {len(mislabelled)}")
    assert not mislabelled
    assert set(versions(url, model)) == {"1"}  # every worker labels the replica with the new weights


def listening_workers(port: int) -> set[int]:
    """Pids of the processes with a socket listening on `port` (each worker has its own)."""
    return {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
            and c.pid is not None}


def wait_for_workers(port: int, n: int, timeout_s: float = 120) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while len(pids := listening_workers(port)) < n:
        assert time.monotonic() < deadline, f"{len(pids)} of {n} workers listening"
        time.sleep(0.2)
    return pids


def test_new_connections_spread_over_every_worker(workers_gateway: tuple[str, str]) -> None:
    """Each worker accepts on its own socket and the kernel spreads connections among them; with one shared
    socket, the worker that wakes first takes a whole burst (proxy/processes.py)."""
    url, db_url = workers_gateway
    port = int(url.rsplit(":", 1)[1])
    workers = wait_for_workers(port, 2)
    log = Path(db_url.removeprefix("sqlite:///")).with_name("gateway.log")
    deadline = time.monotonic() + 10  # the supervisor says so too (it polls its workers' reports)
    while "all 2 gateway workers listen" not in log.read_text():
        assert time.monotonic() < deadline, "the supervisor did not log that every worker listens"
        time.sleep(0.1)
    opened = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
    try:
        time.sleep(0.5)  # every connection accepted
        held = Counter(c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED
                       and c.laddr.port == port and c.pid in workers)
    finally:
        for sock in opened:
            sock.close()
    assert sum(held.values()) == 32
    # Hashing 32 connections over 2 sockets leaves fewer than 4 on one with probability about 2e-6.
    assert min(held[pid] for pid in workers) >= 4, held


def test_a_killed_worker_is_replaced_and_stopping_stops_them_all(own_workers_gateway: tuple[str, str],
                                                                 vllm_server: RunningVLLM) -> None:
    url, _ = own_workers_gateway
    port = int(url.rsplit(":", 1)[1])
    first, second = wait_for_workers(port, 2)
    supervisor = psutil.Process(first).parent()
    assert supervisor is not None
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while first in (pids := listening_workers(port)) or len(pids) < 2:
        assert time.monotonic() < deadline, f"no replacement worker: {pids}"
        time.sleep(0.2)
    assert second in pids
    assert versions(url, vllm_server.model_name, n=4) == ["0"] * 4  # the port still serves
    workers = [psutil.Process(pid) for pid in pids]
    supervisor.terminate()
    gone, alive = psutil.wait_procs([supervisor, *workers], timeout=60)
    assert not alive, alive


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of process `pid`."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("workers", [1, 2])
def test_gateway_cpus_pin_every_thread_of_each_gateway_process(
    workers: int, vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path
) -> None:
    """`--gateway-cpus 0-1`: one process on both CPUs, or each of two workers on one; the store's threads,
    started by the first calls, inherit it."""
    port = free_port()
    log = tmp_path / "gateway.log"
    command = [sys.executable, "-m", "tracetrain.cli", "serve", "--workers", str(workers), "--gateway-cpus", "0-1",
               "--engine", "vllm", "--engine-url", vllm_server.url, "--model", str(smollm2_path),
               "--served-model-name", vllm_server.model_name, "--db-url", f"sqlite:///{tmp_path / 'store.db'}",
               "--port", str(port)]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log)
        pids = wait_for_workers(port, workers)
        versions(url, vllm_server.model_name, n=6)  # every worker answers (fresh connections) and records
        pinned = {pid: thread_cpus(pid) for pid in pids}
        if workers == 1:
            assert pinned == {process.pid: {frozenset({0, 1})}}
            assert "gateway pinned to CPU 0,1" in log.read_text()
        else:
            assert all(len(threads) == 1 for threads in pinned.values()), pinned  # each process on one set
            assert sorted(sorted(cpus) for threads in pinned.values() for cpus in threads) == [[0], [1]], pinned
            assert thread_cpus(process.pid) != {frozenset({0})}  # the supervisor itself is not pinned
    finally:
        process.terminate()
        process.wait(timeout=60)
