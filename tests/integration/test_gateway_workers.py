"""`tracetrain serve --workers 2` in front of the shared vLLM server: both worker processes serve, and a
LoRA version published through one of them (as `tracetrain train --gateway-url` does: POST
/v1/policies, then mark it published in the store) is served by every worker within seconds."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session

from tests.integration.conftest import RunningVLLM
from tests.support.servers import free_port
from tracetrain.store.db import open_engine
from tracetrain.store.models import Policy, utcnow


@pytest.fixture
def workers_gateway(vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    log = tmp_path / "gateway.log"
    command = [sys.executable, "-m", "tracetrain.cli", "serve", "--workers", "2", "--engine", "vllm",
               "--engine-url", vllm_server.url, "--model", str(smollm2_path), "--served-model-name",
               vllm_server.model_name, "--db-url", db_url, "--port", str(port),
               "--set", "train.lora=true", "--set", "train.publish=lora"]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gateway workers did not start"
            time.sleep(0.3)
        yield url, db_url
    finally:
        process.terminate()
        process.wait(timeout=60)


def versions(url: str, model: str, n: int = 16) -> list[str]:
    """X-Policy-Version of `n` new sessions, each on a fresh connection (so the kernel spreads them)."""
    seen = []
    for i in range(n):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={"Connection": "close"},
                              json={"model": model, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": f"hi {i}"}]})
        assert response.status_code == 200, response.text
        seen.append(response.headers["x-policy-version"])
    return seen


def test_a_version_published_through_one_worker_reaches_every_worker(
    workers_gateway: tuple[str, str], vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path
) -> None:
    from tests.integration.test_publish import load_model, save_lora

    url, db_url = workers_gateway
    assert set(versions(url, vllm_server.model_name)) == {"0"}
    adapter = save_lora(load_model(smollm2_path), tmp_path / "v1", seed=3)
    response = httpx.post(f"{url}/v1/policies", timeout=120,
                          json={"version": 1, "checkpoint": str(adapter), "kind": "lora"})
    assert response.status_code == 200, response.text
    with Session(open_engine(db_url)) as db:  # what the trainer writes once the gateway took the version
        db.add(Policy(version=1, checkpoint=str(adapter), kind="lora", published_at=utcnow()))
        db.commit()
    time.sleep(3)  # each worker checks the store for newer published versions every second
    assert set(versions(url, vllm_server.model_name)) == {"1"}
    served = {httpx.get(f"{url}/v1/replicas", timeout=30, headers={"Connection": "close"}).json()["served_version"]
              for _ in range(8)}
    assert served == {1}


def test_workers_refuse_what_they_cannot_keep_consistent(tmp_path: Path) -> None:
    for extra, words in ((["--train"], "own process"), (["--set", "train.publish=reload"], "LoRA publishing"),
                        (["--set", "train.lora=false"], "LoRA publishing")):
        result = subprocess.run([sys.executable, "-m", "tracetrain.cli", "serve", "--workers", "2",
                                 "--engine-url", "http://127.0.0.1:9", "--db-url", f"sqlite:///{tmp_path / 's.db'}",
                                 *extra], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and words in result.stderr, result.stderr[-2000:]
