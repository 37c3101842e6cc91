"""The multi-turn demo agent (tracetrain.demo.tool_agent: LangChain, unchanged) through a real gateway in front
of the real CPU vLLM on SmolLM2-135M: every turn but the last a forced tool call, one reward per episode, and
each episode recorded as one chained trajectory whose sampled tokens, in every turn, carry their version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.servers import RunningGateway

pytest.importorskip("langchain_openai", reason="the langchain extra: bash scripts/setup.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _agent(gateway: RunningGateway, *flags: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "tracetrain.demo.tool_agent", "--gateway", gateway.url,
                           "--model", "smollm2", "--seed", "5", *flags],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_episodes_are_three_turns_rewarded_once_and_chained(vllm_gateway: RunningGateway) -> None:
    out = _agent(vllm_gateway, "--episodes", "4", "--group-size", "2", "--operands", "3", "--log").stdout
    episodes = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(episodes) == 4 and all(e["reward"] in (0.0, 1.0) for e in episodes)
    with httpx.Client(base_url=vllm_gateway.url, timeout=60) as client:
        listed = client.get("/v1/sessions", params={"limit": 50}).json()["data"]
        sessions = [s["id"] for s in listed if s["id"].startswith("tools-")]
        assert len(sessions) == 4
        rewarded = []
        for session in sessions:
            info = client.get(f"/v1/sessions/{session}").json()
            calls = info["calls"]
            assert len(calls) == 3  # two forced add calls, then the answer
            # A forced call is a tool call unless max_tokens cut its JSON; the answer is never one.
            reasons = [c["finish_reason"] for c in calls]
            assert set(reasons[:2]) <= {"tool_calls", "length"} and reasons[2] in ("stop", "length"), reasons
            rewarded.append(info["reward_total"])
            trajectory = client.get(f"/v1/sessions/{session}/trajectory").json()["trajectories"]
            assert len(trajectory) == 1 and len(trajectory[0]["segments"]) == 1  # one sample: the turns chain
            segment = trajectory[0]["segments"][0]
            mask = segment["loss_mask"]
            runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
            assert runs >= 3  # the tokens the model chose in each turn; prompts and tool results masked out
            assert all(v == 0 for v, m in zip(segment["policy_versions"], segment["loss_mask"], strict=True) if m)
    assert sorted(rewarded) == sorted(e["reward"] for e in episodes)


def test_held_out_evaluation_posts_nothing(vllm_gateway: RunningGateway, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    _agent(vllm_gateway, "--eval", "3", "--split", "validation", "--operands", "2", "--out", str(out))
    summary = json.loads(out.read_text())
    assert summary["n"] == 3 and summary["versions"] == [0] and summary["operands"] == 2
    assert 0.0 <= summary["mean_reward"] <= 1.0 and len(summary["replies"]) == 3
    assert summary["reward"] == "partial" and 0.0 <= summary["tools_reached_total"] <= 1.0
    with httpx.Client(base_url=vllm_gateway.url, timeout=60) as client:
        listed = client.get("/v1/sessions", params={"limit": 50}).json()["data"]
    assert len([s for s in listed if s["id"].startswith("tools-eval-")]) == 3
    assert not any(s.get("reward") is not None for s in listed)
