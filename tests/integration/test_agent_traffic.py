"""The demo agent's production-shaped traffic (bench/learning_arms.py's arms), through a real gateway:
one attempt per problem with no group named, rewards late and out of order, only some rewarded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sqlmodel import Session, select

from tests.support.servers import RunningGateway
from tracetrain.store.models import AgentSession, Reward


def _agent(gateway: RunningGateway, *flags: str) -> list[dict[str, object]]:
    done = subprocess.run([sys.executable, "-m", "tracetrain.demo.arithmetic", "--gateway", gateway.url,
                           "--model", "tiny", "--seed", "3", "--log", *flags],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_late_sparse_singletons_arrive_as_sent(gateway: RunningGateway) -> None:
    episodes = _agent(gateway, "--episodes", "12", "--group-size", "1", "--no-group", "--reward-share", "0.5",
                      "--reward-delay", "1", "3")
    posted = sum(bool(e["posted"]) for e in episodes)
    assert len(episodes) == 12 and 0 < posted < 12
    with Session(gateway.gateway.db) as s:
        sessions = {x.id: x for x in s.exec(select(AgentSession)).all()}
        rewards = s.exec(select(Reward)).all()
    assert len(sessions) == 12 and len(rewards) == posted
    # no group in the URL: the gateway's own grouping (a hash of the first prompt), not the agent's names
    assert not any(x.group_id.startswith("add-") for x in sessions.values())
    for reward in rewards:  # each came at least the shortest delay after its episode's call
        assert (reward.created_at - sessions[reward.session_id].created_at).total_seconds() >= 1.0
    unrewarded = [x for x in sessions.values() if x.reward is None]
    assert len(unrewarded) == 12 - posted


def test_flipped_rewards_are_posted_flipped(gateway: RunningGateway) -> None:
    episodes = _agent(gateway, "--episodes", "8", "--group-size", "2", "--reward-flip", "1.0")
    with Session(gateway.gateway.db) as s:
        stored = sorted(x.reward for x in s.exec(select(AgentSession)).all() if x.reward is not None)
    assert stored == sorted(round(1.0 - float(e["reward"]), 4) for e in episodes)  # type: ignore[arg-type]
