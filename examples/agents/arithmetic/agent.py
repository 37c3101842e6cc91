"""Arithmetic agent: the OpenAI SDK, one question per episode, a rule-based reward posted afterwards.

Run it against a gateway:  python examples/agents/arithmetic/agent.py --episodes 32
It knows nothing about tracetrain beyond the base URL it is given and the reward endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
import uuid

import httpx
from openai import AsyncOpenAI

SYSTEM = "You are a calculator. Reply with the result as a number only."


def make_problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, group id): repeats of one question share a group, hence a baseline."""
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"What is {a} + {b}?", a + b, f"add-{a}-{b}"


def score(reply: str, answer: int) -> float:
    """1 for the right number first, 0.2 for the right number elsewhere, 0 otherwise."""
    numbers = re.findall(r"-?\d+", reply)
    if numbers and int(numbers[0]) == answer:
        return 1.0
    return 0.2 if str(answer) in numbers else 0.0


async def episode(gateway: str, model: str, rng: random.Random, api_key: str) -> float:
    question, answer, group = make_problem(rng)
    session = f"arith-{uuid.uuid4().hex[:12]}"
    client = AsyncOpenAI(base_url=f"{gateway}/s/{session}/g/{group}/v1", api_key=api_key)
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=16, temperature=1.0)
    reward = score(reply.choices[0].message.content or "", answer)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}) as http:
        posted = await http.post(f"{gateway}/v1/rewards",
                                 json={"session_id": session, "reward": reward, "final": True})
        posted.raise_for_status()
    return reward


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    rewards: list[float] = []
    started = time.monotonic()

    async def run_one() -> None:
        async with limit:
            rewards.append(await episode(args.gateway, args.model, rng, args.api_key))
            if len(rewards) % 8 == 0 or len(rewards) == args.episodes:
                rate = len(rewards) / (time.monotonic() - started)
                print(f"episodes {len(rewards)}/{args.episodes}  mean reward {sum(rewards) / len(rewards):.3f}"
                      f"  ({rate:.2f} episodes/s)", flush=True)

    await asyncio.gather(*(run_one() for _ in range(args.episodes)))


if __name__ == "__main__":
    asyncio.run(main())
