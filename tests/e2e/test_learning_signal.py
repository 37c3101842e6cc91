"""A test that fails when learning breaks: through the real gateway, store, trainer and publisher, a
small model's reward on a trivially learnable task must rise by a fixed margin within a fixed number of
versions.

The task: the reward of an episode is the share of its sampled tokens that are even digits. The model
(tests/support/digit_model.py) answers every task with digits drawn uniformly, so the untrained reward
is about 0.5. The agent reads the sampled ids from the gateway's own record
(`/v1/sessions/{id}/trajectory`), as an application with token-level access would.

The margin: each evaluation averages `EVAL_EPISODES` episodes of `MAX_TOKENS` tokens, 512 Bernoulli(0.5)
draws at the start, whose standard deviation is 0.022; the held-out mean must rise by `MARGIN` = 0.15,
about seven of those, so chance cannot pass it, while a model that learns at all passes it easily.
A flipped advantage sign drives the reward down, a loss mask that drops the sampled tokens leaves the
weights unchanged, and a publish that leaves the old weights serving keeps the reward where it started:
each of the three fails this test (docs/architecture.md, "The life of a training step").
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.digit_model import (
    REPLY_TOKENS,
    digit_ids,
    digit_model_dir,
    post_final_reward,
    sample_reply,
)
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.config import TrainConfig
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.store.db import open_db
from tracetrain.trainer.service import TrainerThread

pytestmark = pytest.mark.slow

MODEL = "digits"
MAX_TOKENS = REPLY_TOKENS
EVAL_EPISODES = 32
VERSIONS = 6
MARGIN = 0.15
BATCH = 16


@pytest.fixture(scope="module")
def digit_model_path() -> Path:
    return digit_model_dir()


@pytest.fixture
def rewarded_ids(digit_model_path: Path) -> set[int]:
    from transformers import AutoTokenizer

    return set(digit_ids(AutoTokenizer.from_pretrained(str(digit_model_path)))[::2])  # 0, 2, 4, 6, 8


@pytest.fixture
def signal_gateway(digit_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    from tracetrain.engines.transformers_engine import TransformersEngine

    tiny_model_path = digit_model_path
    engine = TransformersEngine(tiny_model_path, model_name=MODEL)
    cfg = TrainConfig(lora=False, lr=3e-3, batch_sessions=BATCH, min_sessions=BATCH, advantage="rloo",
                      micro_batch_tokens=4096, checkpoint_dir=tmp_path / "ckpt", poll_s=0.1, max_staleness=100,
                      group_settle_s=0.5, keep_checkpoints=2)

    db_url = f"sqlite:///{tmp_path / 'signal.db'}"

    def trainer(publish: Any, hold: Any) -> TrainerThread:
        return TrainerThread(cfg, open_db(db_url), tiny_model_path, publish=publish, hold=hold)

    # Redaction off: the model writes 16 random digits, and about one such string in fifty passes the card
    # detector (issuer prefix, length and Luhn), which would mask a whole reply out of the task's figure.
    running = start_gateway(engine, tiny_model_path, db_url, publisher=InProcessPublisher(engine), services=[trainer],
                            gateway={"redaction": "off"})
    running.trainer = running.gateway.services[0]  # type: ignore[attr-defined]
    yield running
    running.stop()


async def _episode(client: httpx.AsyncClient, gw: RunningGateway, prompt: int, rewarded_ids: set[int], *,
                   reward: bool, group: str | None = None) -> float:
    """One call; the reward is the share of its sampled ids that are even digits (posted when `reward`)."""
    session = f"ep-{uuid.uuid4().hex[:10]}"
    sampled = await sample_reply(client, gw, session, prompt, model=MODEL, max_tokens=MAX_TOKENS, admitted=reward,
                                 group=group)
    share = sum(t in rewarded_ids for t in sampled) / len(sampled)
    if reward:
        await post_final_reward(client, gw, session, share)
    return share


async def _held_out(client: httpx.AsyncClient, gw: RunningGateway, rewarded_ids: set[int]) -> float:
    """Unrewarded episodes on prompts training never sees (numbers from 10,000 on)."""
    shares = await asyncio.gather(*(_episode(client, gw, 10_000 + i, rewarded_ids, reward=False)
                                    for i in range(EVAL_EPISODES)))
    return sum(shares) / len(shares)


async def test_reward_rises_on_a_learnable_task(signal_gateway: RunningGateway, rewarded_ids: set[int]) -> None:
    gw = signal_gateway
    async with httpx.AsyncClient(timeout=120) as client:
        before = await _held_out(client, gw, rewarded_ids)
        prompt = 0
        while gw.gateway.engine.version < VERSIONS:
            error = gw.trainer.error  # type: ignore[attr-defined]
            assert error is None, error
            # Groups of four attempts at one prompt, a batch's worth at a time.
            await asyncio.gather(*(_episode(client, gw, prompt + i // 4, rewarded_ids, reward=True,
                                            group=f"g{prompt + i // 4}") for i in range(BATCH)))
            prompt += BATCH // 4
            assert prompt < 4 * BATCH * VERSIONS, "the trainer stopped publishing"
        after = await _held_out(client, gw, rewarded_ids)
    await asyncio.to_thread(gw.trainer.stop)  # type: ignore[attr-defined]
    print(f"held-out share of rewarded tokens: {before:.3f} before, {after:.3f} after {VERSIONS} versions")
    assert after >= before + MARGIN, f"reward did not rise: {before:.3f} -> {after:.3f}"
