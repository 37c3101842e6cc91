"""Arithmetic agent: the OpenAI SDK, one sum per episode, a rule-based reward posted afterwards.

    python examples/agents/arithmetic/agent.py --gateway http://127.0.0.1:8000 --episodes 64
    python examples/agents/arithmetic/agent.py --eval 64 --out eval.json   # held-out, greedy, no rewards

It knows nothing about tracetrain beyond a base URL (which binds the session and the group) and the
reward endpoint. Each problem is attempted `--group-size` times in one group, so group baselines
(GRPO, RLOO) have something to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import uuid
from pathlib import Path

import httpx
from openai import AsyncOpenAI

SYSTEM = "You are a calculator. Reply with only the number."
EXAMPLES = [("What is 3 + 4?", "7"), ("What is 12 + 5?", "17")]
"""Two worked examples in the conversation: the format is shown, the sums are still the model's job."""


def make_problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, group id)."""
    a, b = rng.randint(1, 30), rng.randint(1, 30)
    return f"What is {a} + {b}?", a + b, f"add-{a}-{b}"


def messages(question: str) -> list[dict[str, str]]:
    shots = [m for q, a in EXAMPLES for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": question}]


def score(reply: str, answer: int) -> float:
    """1 for exactly the right number; otherwise up to 0.5 for how close the first number is (0.5 when
    it is right but other text follows). Partial credit gives a 135M model a gradient to climb."""
    text = reply.strip()
    if text == str(answer):
        return 1.0
    numbers = re.findall(r"-?\d+", text)
    if not numbers:
        return 0.0
    return round(0.5 * max(0.0, 1.0 - abs(int(numbers[0]) - answer) / answer), 4)


async def attempt(client: AsyncOpenAI, model: str, question: str, temperature: float) -> tuple[str, int]:
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=messages(question), max_tokens=8, temperature=temperature)  # type: ignore[arg-type]
    reply = raw.parse()
    return reply.choices[0].message.content or "", int(raw.headers.get("x-policy-version", "0"))


async def train_episodes(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    done, total, started = 0, 0.0, time.monotonic()
    deadline = started + args.minutes * 60 if args.minutes else None
    async with httpx.AsyncClient(headers=headers, timeout=120) as http:

        async def one(question: str, answer: int, group: str) -> None:
            nonlocal done, total
            async with limit:
                session = f"arith-{uuid.uuid4().hex[:12]}"
                client = AsyncOpenAI(base_url=f"{args.gateway}/s/{session}/g/{group}/v1", api_key=args.api_key)
                reply, version = await attempt(client, args.model, question, args.temperature)
                reward = score(reply, answer)
                posted = await http.post(f"{args.gateway}/v1/rewards",
                                         json={"session_id": session, "reward": reward, "final": True})
                posted.raise_for_status()
                done, total = done + 1, total + reward
                if args.log:
                    print(json.dumps({"t": round(time.monotonic() - started, 2), "version": version,
                                      "reward": reward}), flush=True)
                elif done % 16 == 0:
                    print(f"episodes {done}  mean reward {total / done:.3f}  "
                          f"({done / (time.monotonic() - started):.2f} episodes/s)", flush=True)

        episode = 0
        while (args.episodes is None or episode < args.episodes) and (deadline is None or time.monotonic() < deadline):
            question, answer, group = make_problem(rng)
            await asyncio.gather(*(one(question, answer, group) for _ in range(args.group_size)))
            episode += args.group_size


async def evaluate(args: argparse.Namespace) -> None:
    """Held-out problems (their own seed), greedy, nothing posted: the trainer never sees them."""
    rng = random.Random(10_000 + args.seed)
    problems = [make_problem(rng) for _ in range(args.eval)]
    client = AsyncOpenAI(base_url=f"{args.gateway}/v1", api_key=args.api_key)
    limit = asyncio.Semaphore(args.concurrency)

    async def one(question: str, answer: int) -> tuple[float, int]:
        async with limit:
            reply, version = await attempt(client, args.model, question, 0.0)
            return score(reply, answer), version

    results = await asyncio.gather(*(one(q, a) for q, a, _ in problems))
    summary = {"mean_reward": sum(r for r, _ in results) / len(results), "n": len(results),
               "exact": sum(r == 1.0 for r, _ in results) / len(results), "versions": sorted({v for _, v in results})}
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=None, help="stop after this many episodes")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", action="store_true", help="print one JSON line per episode")
    parser.add_argument("--eval", type=int, default=0, help="evaluate on this many held-out problems instead")
    parser.add_argument("--out", help="with --eval: write the summary here")
    args = parser.parse_args()
    if args.episodes is None and args.minutes is None and not args.eval:
        args.episodes = 64
    asyncio.run(evaluate(args) if args.eval else train_episodes(args))


if __name__ == "__main__":
    sys.exit(main())
