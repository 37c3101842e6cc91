"""The README's demo end to end: `tracetrain demo` starts vLLM and the gateway, runs the unmodified
arithmetic agent through it, the agent posts rewards, and everything lands in the store."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import free_port

pytestmark = pytest.mark.vllm


def test_demo_captures_every_episode_with_its_reward(tmp_path: Path) -> None:
    from tracetrain.engines.vllm_server import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip("vLLM is not installed")
    port, vllm_port = free_port(), free_port()
    result = subprocess.run(
        [sys.executable, "-m", "tracetrain.cli", "demo", "--episodes", "8", "--port", str(port),
         "--out", str(tmp_path), "--engine", "vllm", "--vllm-port", str(vllm_port)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "episodes 8/8" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        assert row["final"] is True and row["reward"] in (0.0, 0.2, 1.0)
        assert sum(row["loss_mask"]) > 0 and len(row["input_ids"]) == len(row["loss_mask"])
    with socket.socket() as sock:  # the demo stopped the vLLM server it started
        assert sock.connect_ex(("127.0.0.1", vllm_port)) != 0
