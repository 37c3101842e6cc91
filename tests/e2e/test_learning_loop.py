"""agent → gateway → engine → store → trainer → swap, in one process with the in-process engine.

Agents keep running while the trainer steps and swaps weights; nothing fails, every response names
the version that produced it, and the store records what each version consumed and skipped.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, col, select

from tests.support.servers import RunningGateway, start_gateway
from tracetrain.config import TrainConfig
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Call, Policy
from tracetrain.trainer.service import TrainerThread

pytestmark = pytest.mark.slow

MODEL = "tiny"


def _train_config(tmp_path: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"advantage": "grpo", "lora": False, "lr": 1e-3, "batch_sessions": 8, "min_sessions": 8,
                              "micro_batch_tokens": 2048, "checkpoint_dir": tmp_path / "ckpt", "poll_s": 0.1,
                              "max_staleness": 100}
    return TrainConfig(**{**values, **overrides})


@pytest.fixture
def learning_gateway(tiny_model_path: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RunningGateway]:
    from tracetrain.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_model_path, model_name=MODEL)
    db_url = f"sqlite:///{tmp_path / 'learn.db'}"
    cfg = _train_config(tmp_path, **getattr(request, "param", {}))

    def trainer(publish: Any, hold: Any) -> TrainerThread:
        return TrainerThread(cfg, open_db(db_url), tiny_model_path, publish=publish, hold=hold)

    running = start_gateway(engine, tiny_model_path, db_url, publisher=InProcessPublisher(engine), services=[trainer])
    running.trainer = running.gateway.services[0]  # type: ignore[attr-defined]
    yield running
    running.stop()


async def _agents(gw: RunningGateway, episodes: int, versions: list[int], failures: list[str]) -> None:
    """Groups of 4 attempts at the same prompt; the reward is a rule on the reply (its length parity)."""
    async with httpx.AsyncClient(timeout=60) as client:
        async def episode(i: int) -> None:
            session, group = f"ep-{uuid.uuid4().hex[:8]}", f"prompt-{i // 4}"
            response = await client.post(f"{gw.v1(session, group)}/chat/completions", json={
                "model": MODEL, "max_tokens": 6, "temperature": 1.0,
                "messages": [{"role": "user", "content": f"Say something about {i // 4}."}]})
            if response.status_code != 200:
                failures.append(response.text)
                return
            versions.append(int(response.headers["x-policy-version"]))
            reward = float(len(response.json()["choices"][0]["message"]["content"]) % 2)
            posted = await client.post(f"{gw.url}/v1/rewards", json={"session_id": session, "reward": reward,
                                                                      "final": True})
            if posted.status_code != 200:
                failures.append(posted.text)

        for start in range(0, episodes, 8):
            await asyncio.gather(*(episode(i) for i in range(start, min(start + 8, episodes))))


async def _wait_for_version(gw: RunningGateway, version: int, timeout: float = 120) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while gw.gateway.engine.version < version:
        trainer_error = gw.trainer.error  # type: ignore[attr-defined]
        assert trainer_error is None, trainer_error
        assert asyncio.get_running_loop().time() < deadline, "trainer did not publish in time"
        await asyncio.sleep(0.1)


async def test_agents_keep_running_while_versions_advance(learning_gateway: RunningGateway) -> None:
    versions: list[int] = []
    failures: list[str] = []
    await _agents(learning_gateway, 48, versions, failures)
    await _wait_for_version(learning_gateway, 2)
    await _agents(learning_gateway, 16, versions, failures)
    # The trainer goes on stepping in its thread; stop it (off the event loop, which its publish needs) so
    # that the step in progress finishes publishing before the store is read.
    await asyncio.to_thread(learning_gateway.trainer.stop)  # type: ignore[attr-defined]

    assert failures == []
    assert max(versions) >= 2, "later responses come from newer policies"
    with Session(learning_gateway.gateway.db) as db:
        policies = db.exec(select(Policy).where(Policy.version > 0).order_by(col(Policy.version))).all()
        calls = db.exec(select(Call)).all()
        consumed = db.exec(select(AgentSession).where(col(AgentSession.trained_version).is_not(None))).all()
        unused = db.exec(select(AgentSession).where(col(AgentSession.skip_reason).is_not(None))).all()
    assert [p.version for p in policies][:2] == [1, 2]
    for policy in policies:
        assert policy.published_at is not None and policy.publish_error is None
        assert Path(policy.checkpoint or "").joinpath("model.safetensors").exists() or policy.version <= \
            policies[-1].version - 3  # older checkpoints are pruned
        assert policy.metrics["samples"] > 0 and "reward_mean" in policy.metrics
    assert {c.policy_version for c in calls} >= {0, 1}
    assert len(consumed) >= 16
    assert all(s.skip_reason is None for s in consumed), "what a step cannot use is set aside, not consumed"
    for policy in policies:  # each version says what it trained on and how old it was
        assert sum(policy.metrics["staleness"].values()) == policy.metrics["samples"]
        assert policy.metrics["sessions"] >= 8 and policy.metrics["age_s"]["max"] >= 0
    for policy in policies:  # and where its step's time went, each part measured
        times = policy.metrics["time_s"]
        assert set(times) == {"wait_data", "claim", "forward_backward", "optimizer", "checkpoint", "publish"}
        assert all(t >= 0 for t in times.values()) and times["forward_backward"] > 0 and times["checkpoint"] > 0
    served = {c.policy_version for c in calls}
    for policy in policies:  # the first call of every version that served one is dated after its publish
        if policy.version in served:
            assert policy.first_call_at is not None and policy.published_at is not None
            assert policy.first_call_at >= policy.published_at
    listing = httpx.get(f"{learning_gateway.url}/v1/policies").json()
    assert listing["sessions"]["set_aside"] == {reason: len([s for s in unused if s.skip_reason == reason])
                                                for reason in {s.skip_reason for s in unused}}


@pytest.mark.parametrize("learning_gateway", [{"mode": "sync", "max_staleness": 0}], indirect=True)
async def test_sync_mode_trains_on_policy_only(learning_gateway: RunningGateway) -> None:
    versions: list[int] = []
    failures: list[str] = []
    await _agents(learning_gateway, 32, versions, failures)
    await _wait_for_version(learning_gateway, 1)
    await _agents(learning_gateway, 16, versions, failures)
    assert failures == []
    trainer = learning_gateway.trainer  # type: ignore[attr-defined]
    assert trainer.error is None
    with Session(learning_gateway.gateway.db) as db:
        trained = db.exec(select(AgentSession).where(col(AgentSession.trained_version).is_not(None),
                                                     col(AgentSession.skip_reason).is_(None))).all()
        behaviour = {s.id: {c.policy_version for c in db.exec(select(Call).where(Call.session_id == s.id))}
                     for s in trained}
    assert trained
    # Generation is closed while a step trains, so each step learns from its own policy's samples only.
    for session in trained:
        assert behaviour[session.id] == {session.trained_version - 1}
