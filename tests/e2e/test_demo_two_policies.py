"""`tracetrain demo --two-policies`, shortened, on the in-process engine and the tiny random model: two agents
bound to two named policies by path, each policy trained on its own sessions and served its own versions.
This checks the machinery only: the tiny model answers noise. Whether each policy learns its own rule is
measured over seeds with SmolLM2 on vLLM by `python -m bench.policies --parts learning`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session

from tests.support.servers import free_port
from tracetrain.engines.models import tiny_model_dir
from tracetrain.store import queries
from tracetrain.store.db import open_db

pytestmark = pytest.mark.slow


def test_two_policy_demo_trains_each_policy_on_its_own_agent(tmp_path: Path) -> None:
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "tracetrain.cli", "demo", "--two-policies", "--minutes", "10", "--eval-size", "8",
         "--port", str(port), "--out", str(tmp_path), "--engine", "transformers",
         "--set", f"engine.model={tiny_model_dir()}", "--set", "engine.served_model_name=smollm2-135m-instruct",
         "--agent-args", "--episodes 32 --concurrency 4", "--set", "batch_sessions=16", "--set", "min_sessions=16",
         "--set", "flat_groups=baseline"],  # the tiny model earns no reward: train its flat groups anyway
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["episodes"] == {"first": 32, "second": 32}
    for policy in ("first", "second"):
        assert summary["before"][policy]["versions"] == [0] and summary["before"][policy]["n"] == 8
        assert summary["after"][policy]["versions"][0] >= 1, f"{policy}'s evaluation after is served a trained version"
        shares = summary["after"][policy]
        assert shares["first"] + shares["second"] + shares["other"] == pytest.approx(1.0)
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert {e["policy"] for e in episodes} == {"first", "second"}
    assert (tmp_path / "reward.png").stat().st_size > 10_000
    with pytest.raises(httpx.TransportError):  # the demo stopped the gateway it started
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    # The store keeps every session under the policy its agent's path named, and only there; each policy's
    # newest version is the one its evaluation was served; the default policy, with no traffic, never trained.
    with Session(open_db(f"sqlite:///{tmp_path / 'store.db'}")) as db:
        for policy, other in (("first", "second"), ("second", "first")):
            ids = queries.all_session_ids(db, policy=policy)  # the agents name their sessions after their policy
            assert sum(i.startswith(f"{policy}-") for i in ids) == 32
            assert not any(i.startswith(f"{other}-") for i in ids)
            newest = queries.latest_published(db, line=policy)
            assert newest is not None and [newest.version] == summary["after"][policy]["versions"]
        assert queries.latest_published(db) is None
