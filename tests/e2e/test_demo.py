"""The README's demo end to end, shortened: `tracetrain demo` starts vLLM, the gateway and the trainer,
evaluates, runs the unmodified arithmetic agent while new versions are hot-swapped in, evaluates again
and plots. (The full-length run and its figures are in the README; this checks the machinery.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import free_port
from tests.support.setup_steps import VLLM_MISSING

pytestmark = pytest.mark.vllm


def test_short_demo_trains_publishes_and_plots(tmp_path: Path) -> None:
    from tracetrain.engines.vllm_server import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip(VLLM_MISSING)
    port, vllm_port = free_port(), free_port()
    # The agent stops after the first group served by a trained version: one hot swap under running
    # agents is what the assertions below need; `--minutes` only bounds a run where none comes. A batch
    # of three groups (the agent's group size is 8) leaves fewer sessions than a batch behind when the
    # agent stops, so no second step holds the evaluation after training.
    result = subprocess.run(
        [sys.executable, "-m", "tracetrain.cli", "demo", "--minutes", "2", "--eval-size", "8", "--port", str(port),
         "--vllm-port", str(vllm_port), "--out", str(tmp_path), "--engine", "vllm",
         "--set", "batch_sessions=24", "--set", "min_sessions=24", "--agent-args", "--until-version 1"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    before = json.loads((tmp_path / "eval_before.json").read_text())
    after = json.loads((tmp_path / "eval_after.json").read_text())
    assert before["n"] == after["n"] == 8 and before["versions"] == [0]
    assert after["versions"][0] >= 1, "the evaluation after training is served by a trained version"
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len({e["version"] for e in episodes}) >= 2, "agents kept running across a hot swap"
    assert (tmp_path / "reward.png").stat().st_size > 10_000
    with socket.socket() as sock:  # the demo stopped the vLLM server it started
        assert sock.connect_ex(("127.0.0.1", vllm_port)) != 0
