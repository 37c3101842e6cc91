"""Guess-the-number: a multi-step game whose reward comes only at the end, posted late.

    python examples/agents/text_game/agent.py --gateway http://127.0.0.1:8000 --episodes 16

The model guesses a secret number between 1 and `--high`; after every guess the game answers
"higher" or "lower" as the next user turn. The conversation is never edited, so the gateway records
each game as ONE trajectory. Nothing is rewarded while playing: when the game ends the agent waits
`--reward-delay` seconds (a judge, a test suite or a human would take longer) and posts one reward on
the game's last call, by its completion id, with `final: true`. The trainer discounts per-call
rewards back to the first turn (`train.gamma`), so a game won in fewer guesses is worth more.

Uses the OpenAI adapter (`tracetrain.adapters.openai.OpenAISession`): a session per game, games of
the same secret number in one group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracetrain.adapters.openai import OpenAISession

RULES = ("We play guess-the-number. I picked a whole number from 1 to {high}. Reply with one number only. "
         "After each guess I say 'higher' or 'lower'.")


@dataclass
class Game:
    """The environment: a secret number and the feedback for a guess."""

    secret: int
    high: int
    guesses: list[int | None] = field(default_factory=list)

    def feedback(self, reply: str) -> str | None:
        """The next user message, or None when the game is won."""
        found = re.search(r"-?\d+", reply)
        guess = int(found.group()) if found else None
        self.guesses.append(guess)
        if guess == self.secret:
            return None
        if guess is None:
            return f"That is not a number. Reply with one number from 1 to {self.high}."
        return "higher" if guess < self.secret else "lower"

    @property
    def won(self) -> bool:
        return bool(self.guesses) and self.guesses[-1] == self.secret

    def reward(self) -> float:
        """1 for a win (the trainer's discount makes late wins worth less); otherwise up to 0.5 for how
        close the last guess came, so a weak model still has a gradient."""
        if self.won:
            return 1.0
        last = next((g for g in reversed(self.guesses) if g is not None), None)
        if last is None:
            return 0.0
        return round(0.5 * max(0.0, 1.0 - abs(last - self.secret) / self.high), 4)


async def play(args: argparse.Namespace, secret: int, group: str) -> dict[str, Any]:
    game = Game(secret, args.high)
    async with OpenAISession(args.gateway, group_id=group, api_key=args.api_key) as session:
        messages: list[Any] = [{"role": "user", "content": RULES.format(high=args.high)}]
        last_id = ""
        for _ in range(args.max_turns):
            reply = await session.async_client.chat.completions.create(
                model=args.model, messages=messages, max_tokens=8, temperature=args.temperature)
            text = reply.choices[0].message.content or ""
            last_id = reply.id
            messages.append({"role": "assistant", "content": text})
            feedback = game.feedback(text)
            if feedback is None:
                break
            messages.append({"role": "user", "content": feedback})
        await asyncio.sleep(args.reward_delay)
        reward = game.reward()
        await session.areward(reward, completion_id=last_id, final=True)
        return {"session_id": session.session_id, "secret": secret, "turns": len(game.guesses),
                "won": game.won, "reward": reward, "last_completion_id": last_id}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    started = time.monotonic()
    results: list[dict[str, Any]] = []

    async def one(secret: int, group: str) -> None:
        async with limit:
            result = await play(args, secret, group)
        results.append(result)
        if len(results) % 8 == 0 or len(results) == args.episodes:
            n, wins = len(results), sum(r["won"] for r in results)
            print(f"games {n}  won {wins}  mean reward {sum(r['reward'] for r in results) / n:.3f}"
                  f"  mean turns {sum(r['turns'] for r in results) / n:.1f}"
                  f"  ({n / (time.monotonic() - started):.2f} games/s)", flush=True)

    tasks = []
    for start in range(0, args.episodes, args.group_size):
        secret = rng.randint(1, args.high)
        group = f"guess-{args.seed}-{start}-{secret}"
        tasks += [one(secret, group) for _ in range(min(args.group_size, args.episodes - start))]
    await asyncio.gather(*tasks)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--high", type=int, default=10, help="the secret is from 1 to this")
    parser.add_argument("--max-turns", type=int, default=5)
    parser.add_argument("--reward-delay", type=float, default=2.0, help="seconds between game end and reward")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write one JSON object per game here")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
