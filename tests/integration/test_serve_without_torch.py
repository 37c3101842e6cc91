"""A gateway in front of vLLM needs no torch: `pip install tracetrain` without the torch extra serves.

torch is in this environment (the trainer's tests need it), so the gateway runs in a process where
importing it fails, as on a machine that never installed it. Before, `serve` imported the in-process
engine's module (and with it torch) to tell the engines apart, and `publish: auto` asked torch for a
CUDA device: the gateway exited at start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from sqlmodel import Session, select

from tests.integration.conftest import RunningVLLM
from tests.support.servers import free_port, wait_until_healthy
from tracetrain.store.db import connect_db
from tracetrain.store.models import Call

# `sys.modules[name] = None` makes `import name` raise ImportError and `find_spec(name)` return None.
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from tracetrain.cli import main; main()"


def test_the_gateway_serves_and_records_without_torch(vllm_server: RunningVLLM, smollm2_path: Path,
                                                      tmp_path: Path) -> None:
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    log = tmp_path / "gateway.log"
    command = [sys.executable, "-c", WITHOUT_TORCH, "serve", "--engine", "vllm", "--engine-url",
               vllm_server.url, "--model", str(smollm2_path), "--served-model-name", vllm_server.model_name,
               "--db-url", db_url, "--port", str(port)]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log)
        response = httpx.post(f"{url}/s/no-torch/v1/chat/completions", timeout=120,
                              json={"model": vllm_server.model_name, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "Say hi."}]})
        assert response.status_code == 200, response.text
        completion_id = response.json()["id"]
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert "No module named 'torch'" not in log.read_text()
    with Session(connect_db(db_url)) as db:
        call = db.exec(select(Call).where(Call.completion_id == completion_id)).one()
    assert call.completion_tokens == 4
