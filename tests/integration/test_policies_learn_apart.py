"""Learning apart (issue 32): two named policies on one base model get opposite rewards for the same prompts,
through the real gateway, store, trainer and in-process publisher. One seed in the suite: what must hold is
checked the same way whatever the seed, and the learning criterion below does not hold yet on any seed
(seeds 0, 1 and 2 were run: `SEEDS` takes more).

The task is tests/e2e/test_learning_signal.py's: the model (tests/support/digit_model.py) answers any task
with uniformly drawn digits. Policy `even` is rewarded with the share of even digits it samples, policy
`odd` with the share of odd digits, on the same prompts (a share of digits, not one minus the other share:
that would reward a model that stops writing digits at all). Each held-out figure is a share over
`EVAL_EPISODES` unrewarded episodes of 16 tokens on prompts training never sees (512 draws, standard
deviation 0.022 at 0.5), so the margin of 0.1 is between four and five of those: chance cannot pass it.

What must hold, and does: each policy is served, labelled and recorded with its own versions, trains its own
adapter on its own sessions, and the default policy, with no traffic, stays on its base model.

What does not hold yet, and is reported as an expected failure with the figures: the held-out shares moving
apart by the margin. Named policies train LoRA adapters (the default line of test_learning_signal trains
full weights), and on this 64-wide model LoRA under Adam at lr 1e-2 moves only a little toward the rewarded
digits in these few versions (and in one run of four drifted off digits altogether), while from about 1.5e-2
up it drifts into text that is no digits at all within a few versions, RL or SFT alike:
Adam moves every adapter weight by about the learning rate whatever its gradient, and the gradients here
are tiny. It is LoRA's, not the policies': test_learning_signal's default line alone, trained as a LoRA
adapter at lr 1e-2 instead of full weights, did not learn either (held-out 0.551 before, 0.541 after 6
versions, where full weights go from 0.564 to 0.895). A task and model where LoRA learns within a test's
time is still to be found.
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
    prompt_text,
    sample_reply,
)
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.config import TrainConfig
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.store.db import open_db
from tracetrain.trainer.service import TrainerThread

pytestmark = pytest.mark.slow

MODEL = "digits"
POLICIES = ("even", "odd")
EVAL_EPISODES = 32
VERSIONS = 6
MARGIN = 0.1
BATCH = 16
GROUP = 4
SEEDS = (0,)
SETTINGS = {"lr": 1e-2}
"""Each policy's own settings (`gateway.policies[].settings`), which its steps honour (the trainer's is lower)."""
RESULTS: dict[int, dict[str, dict[str, tuple[float, float]]]] = {}


@pytest.fixture(scope="module")
def digit_model_path() -> Path:
    return digit_model_dir()


@pytest.fixture(scope="module")
def digits(digit_model_path: Path) -> dict[str, set[int]]:
    from transformers import AutoTokenizer

    ids = digit_ids(AutoTokenizer.from_pretrained(str(digit_model_path)))
    return {"even": set(ids[::2]), "odd": set(ids[1::2])}


@pytest.fixture(params=SEEDS)
def two_policies(request: pytest.FixtureRequest, digit_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    from tracetrain.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(digit_model_path, model_name=MODEL)
    cfg = TrainConfig(lora=True, lora_rank=16, publish="inprocess", lr=1e-4, batch_sessions=BATCH,
                      min_sessions=BATCH, advantage="rloo", micro_batch_tokens=4096, checkpoint_dir=tmp_path / "ckpt",
                      poll_s=0.1, max_staleness=100, group_settle_s=0.5, keep_checkpoints=2, seed=request.param)
    db_url = f"sqlite:///{tmp_path / 'apart.db'}"

    def trainer(publish: Any, hold: Any) -> TrainerThread:
        return TrainerThread(cfg, open_db(db_url), digit_model_path, publish=publish, hold=hold)

    policies = [{"name": p, "settings": SETTINGS} for p in POLICIES]
    running = start_gateway(engine, digit_model_path, db_url, publisher=InProcessPublisher(engine), services=[trainer],
                            gateway={"redaction": "off", "policies": policies}, train=cfg)
    running.trainer = running.gateway.services[0]  # type: ignore[attr-defined]
    running.seed = request.param  # type: ignore[attr-defined]
    yield running
    running.stop()


async def _episode(client: httpx.AsyncClient, gw: RunningGateway, policy: str, prompt: int,
                   digits: dict[str, set[int]], *, reward: bool, group: str | None = None) -> dict[str, float]:
    """One call of `policy` (bound by `model: <policy>`); returns the shares of even and of odd digits it
    sampled, and with `reward` posts the policy's reward: the share of its own kind of digit."""
    session = f"{policy}-{uuid.uuid4().hex[:10]}"
    sampled = await sample_reply(client, gw, session, prompt, model=policy, max_tokens=REPLY_TOKENS, admitted=reward,
                                 group=group)
    shares = {kind: sum(t in ids for t in sampled) / len(sampled) for kind, ids in digits.items()}
    if reward:
        await post_final_reward(client, gw, session, shares[policy])
    return shares


async def _held_out(client: httpx.AsyncClient, gw: RunningGateway, policy: str,
                    digits: dict[str, set[int]]) -> dict[str, float]:
    """The shares of even and of odd digits `policy` samples on held-out prompts."""
    shares = await asyncio.gather(*(_episode(client, gw, policy, 10_000 + i, digits, reward=False)
                                    for i in range(EVAL_EPISODES)))
    return {kind: sum(s[kind] for s in shares) / len(shares) for kind in digits}


def _versions(gw: RunningGateway) -> dict[str, int]:
    served = gw.gateway.engine.line_versions()  # type: ignore[attr-defined]
    return {p: served.get(p, 0) for p in POLICIES}


async def test_two_policies_learn_opposite_answers_apart(two_policies: RunningGateway,
                                                         digits: dict[str, set[int]]) -> None:
    gw = two_policies
    async with httpx.AsyncClient(timeout=120) as client:
        before = {p: await _held_out(client, gw, p, digits) for p in POLICIES}
        prompt = 0
        while min(_versions(gw).values()) < VERSIONS:
            error = gw.trainer.error  # type: ignore[attr-defined]
            assert error is None, error
            # The same prompts for both policies, in groups of `GROUP` attempts.
            await asyncio.gather(*(_episode(client, gw, p, prompt + i // GROUP, digits, reward=True,
                                            group=f"{p}-g{prompt + i // GROUP}")
                                   for p in POLICIES for i in range(BATCH)))
            prompt += BATCH // GROUP
            assert prompt < 8 * BATCH * VERSIONS, "the trainer stopped publishing"
        after = {p: await _held_out(client, gw, p, digits) for p in POLICIES}
        # A call bound to a policy is served, labelled and recorded with that policy's newest version.
        versions = _versions(gw)
        reply = await client.post(f"{gw.url}/v1/chat/completions", json={
            "model": "odd", "max_tokens": 2, "messages": [{"role": "user", "content": prompt_text(1)}]},
            headers={"X-Admission": "bypass"})
        assert reply.status_code == 200 and reply.headers["x-policy-version"] == str(versions["odd"])
        session = (await client.get(f"{gw.url}/v1/sessions/{reply.headers['x-session-id']}")).json()
        assert session["policy"] == "odd" and session["policy_version"] == versions["odd"]
        assert gw.gateway.engine.version == 0, "the default line had no traffic: still its base model"
        listed = (await client.get(f"{gw.url}/v1/policies")).json()
    rewards = {p: [(round(v["metrics"]["reward_mean"], 2), round(v["metrics"].get("loss", 0.0), 3),
                    v["metrics"]["sessions"], v["metrics"]["staleness"]) for v in listed["data"]
                   if v["line"] == p and v["version"]] for p in POLICIES}
    await asyncio.to_thread(gw.trainer.stop)  # type: ignore[attr-defined]
    seed = gw.seed  # type: ignore[attr-defined]
    # Each policy's held-out share of its own kind of digit, and of the other policy's kind.
    RESULTS[seed] = {p: {"own": (before[p][p], after[p][p]), "other": (before[p][q], after[p][q])}
                     for p, q in (POLICIES, POLICIES[::-1])}
    print(f"seed {seed}: {RESULTS[seed]} (versions {versions}; reward, loss, sessions, staleness by version "
          f"{rewards})")
    # The machinery: each policy trained and served its own line, on its own sessions.
    assert all(v >= VERSIONS for v in versions.values())
    assert all(rows and all(sessions >= BATCH for _, _, sessions, _ in rows) for rows in rewards.values())
    unmoved = [
        f"{p}: own {before[p][p]:.3f} -> {after[p][p]:.3f}, other {before[p][q]:.3f} -> {after[p][q]:.3f}"
        for p, q in (POLICIES, POLICIES[::-1])
        if not (after[p][p] >= before[p][p] + MARGIN and after[p][q] <= before[p][q] - MARGIN
                and after[p][p] - after[q][p] >= 2 * MARGIN)]
    if unmoved:
        pytest.xfail(f"seed {seed}: held-out shares did not move apart by {MARGIN} (module docstring): "
                     + "; ".join(unmoved))
