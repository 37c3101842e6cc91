"""A tiny model that answers any task with random digits: a starting point reinforcement learning can move.

A randomly initialised model spreads its samples over SmolLM2's 49,152 tokens, so a reward defined on
a few of them is almost never earned and learning from it takes far longer than a test may. This model
is taught here, in seconds, to answer "Task N: write anything." with digits drawn uniformly, so half
of what it samples is an even digit before any reinforcement learning and a policy that prefers even
digits is a few rows of weights away. tests/e2e/test_learning_signal.py trains it through the gateway.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from tracetrain.engines.models import cache_root, save_model_dir, tiny_model_dir
from tracetrain.proxy.render import ChatRenderer

if TYPE_CHECKING:
    import httpx

    from tests.support.servers import RunningGateway

DIGITS = "0123456789"
REPLY_TOKENS = 16


def prompt_text(task: int) -> str:
    return f"Task {task}: write anything."


def digit_ids(tokenizer: object) -> list[int]:
    """The token id of each digit (SmolLM2's vocabulary has one token per digit)."""
    ids = [tokenizer.convert_tokens_to_ids(d) for d in DIGITS]  # type: ignore[attr-defined]
    assert len(set(ids)) == 10, ids
    return ids


def digit_model_dir(steps: int = 300) -> Path:
    target = cache_root() / f"tiny-digit-model-s{steps}-v1"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tiny_model_dir(hidden=64)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    renderer = ChatRenderer(tokenizer)
    digits = digit_ids(tokenizer)
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = []
        for _ in range(8):
            prompt = renderer.render([{"role": "user", "content": prompt_text(rng.randrange(100_000))}], None,
                                     generation=True)
            batch.append((prompt, [rng.choice(digits) for _ in range(REPLY_TOKENS)]))
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.tensor([p + r + [0] * (width - len(p) - len(r)) for p, r in batch])
        labels = torch.tensor([[-100] * len(p) + r + [-100] * (width - len(p) - len(r)) for p, r in batch])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    # Uniform over ten digits is a loss of ln(10) = 2.30 per token: anything close means digits, evenly.
    if loss.item() > 2.45:
        raise RuntimeError(f"the digit model did not converge (loss {loss.item():.3f})")
    return save_model_dir(target, model, tokenizer)


async def sample_reply(client: httpx.AsyncClient, gw: RunningGateway, session: str, task: int, *, model: str,
                       max_tokens: int, admitted: bool = True, group: str | None = None) -> list[int]:
    """One chat call on task `task` in `session` at temperature 1; the token ids it sampled, read back from the
    session's recorded trajectory (its loss-masked tokens). Not `admitted`: a held-out call that bypasses
    admission, as an evaluation does."""
    response = await client.post(f"{gw.v1(session, group)}/chat/completions", json={
        "model": model, "max_tokens": max_tokens, "temperature": 1.0, "stop": [],
        "messages": [{"role": "user", "content": prompt_text(task)}]},
        headers={} if admitted else {"X-Admission": "bypass"})
    assert response.status_code == 200, response.text
    trajectory = (await client.get(f"{gw.url}/v1/sessions/{session}/trajectory")).json()
    segment = trajectory["trajectories"][0]["segments"][0]
    return [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]


async def post_final_reward(client: httpx.AsyncClient, gw: RunningGateway, session: str, reward: float) -> None:
    posted = await client.post(f"{gw.url}/v1/rewards", json={"session_id": session, "reward": reward, "final": True})
    assert posted.status_code == 200, posted.text
