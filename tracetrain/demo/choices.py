"""The two-policy demo's agent: one question, two options, and a rule about which option earns the reward.

    python -m tracetrain.demo.choices --policy first --prefer first --minutes 10 --log
    python -m tracetrain.demo.choices --policy second --eval 64 --out eval.json   # held-out, greedy

Every question is "Which do you prefer, X or Y?". The agent bound to policy `first` is rewarded for
answering the option asked first, the one bound to `second` for the option asked second: the same
prompts, opposite rewards. The base model mostly names the first option, so `second` has far to go
and `first` little; each must learn its own rule without pulling the other along
(`tracetrain demo --two-policies`, bench/results/policies.md).

The agent knows nothing about tracetrain beyond a base URL: `/p/{policy}` binds its calls to the named
policy, `/s/{session}/g/{group}` its session and group, and the reward goes to the reward endpoint.

**The split.** Options come in pairs from one category (two fruits, two seasons, ...). Pairs are split
once, by a fixed seed, on the *unordered* pair: `TEST` (every held-out figure), `VALIDATION` (for
choosing settings) and `TRAIN`. A pair is asked in either order in training, so a policy cannot pass
the held-out set by remembering which word of a pair to name: it must learn where its option stands.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import sys
import time
import uuid
from pathlib import Path

import httpx
from openai import APIError, AsyncOpenAI

SYSTEM = "Answer with one of the two words only."
EXAMPLES = [(("salt", "pepper"), "salt"), (("day", "night"), "night")]
"""Two worked examples show the format, one naming each position, so neither rule is taught by them."""
MAX_TOKENS = 4
RETRIES = 20
"""Retries per request (429s while the trainer catches up, a loading engine's 503s)."""

CATEGORIES = {
    "fruit": ["apples", "oranges", "bananas", "grapes", "pears", "plums", "cherries", "lemons", "melons", "peaches"],
    "animal": ["cats", "dogs", "horses", "rabbits", "parrots", "turtles", "hamsters", "goats", "ducks", "sheep"],
    "drink": ["tea", "coffee", "milk", "juice", "water", "cocoa", "lemonade", "soda", "cider", "smoothies"],
    "place": ["mountains", "beaches", "forests", "deserts", "cities", "villages", "islands", "lakes", "rivers",
              "valleys"],
    "pastime": ["books", "movies", "music", "games", "puzzles", "painting", "cooking", "gardening", "hiking",
                "swimming"],
    "colour": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown"],
}
SPLIT_SEED = 20_261_127
"""Fixed forever: changing it changes which pairs are held out, and every earlier figure with it."""
TEST_SIZE, VALIDATION_SIZE = 64, 48
Pair = tuple[str, str]


def _split() -> tuple[list[Pair], list[Pair], list[Pair]]:
    pairs: list[Pair] = sorted((min(a, b), max(a, b)) for words in CATEGORIES.values()
                               for a, b in itertools.combinations(words, 2))
    shown = {(min(a, b), max(a, b)) for (a, b), _ in EXAMPLES}
    candidates = [p for p in pairs if p not in shown]
    random.Random(SPLIT_SEED).shuffle(candidates)
    test = candidates[:TEST_SIZE]
    validation = candidates[TEST_SIZE: TEST_SIZE + VALIDATION_SIZE]
    return sorted(candidates[TEST_SIZE + VALIDATION_SIZE:]), validation, test


TRAIN, VALIDATION, TEST = _split()
"""Unordered pairs: 158 for training, 48 for validation, 64 held out (the example pairs are in no split)."""


def question(first: str, second: str) -> str:
    return f"Which do you prefer, {first} or {second}?"


def messages(first: str, second: str) -> list[dict[str, str]]:
    shots = [m for (a, b), answer in EXAMPLES
             for m in ({"role": "user", "content": question(a, b)}, {"role": "assistant", "content": answer})]
    return [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": question(first, second)}]


def make_problem(rng: random.Random) -> Pair:
    """A training question's options in the order asked: a pair from `TRAIN`, either way round."""
    a, b = rng.choice(TRAIN)
    return (a, b) if rng.random() < 0.5 else (b, a)


def held_out(n: int, split: str = "test") -> list[Pair]:
    """The first `n` questions of the held-out `test` (or `validation`) set, each in one fixed order."""
    pool = {"test": TEST, "validation": VALIDATION}[split]
    if not 0 < n <= len(pool):
        raise ValueError(f"the {split} set has {len(pool)} pairs; asked for {n}")
    order = random.Random(SPLIT_SEED + 1)
    return [(a, b) if order.random() < 0.5 else (b, a) for a, b in pool][:n]


def named(reply: str, first: str, second: str) -> str:
    """Which option the reply names: `first`, `second`, or `other` (neither, or both). A word counts in
    the singular too ("apple" for "apples")."""
    words = set(re.findall(r"[a-z]+", reply.lower()))

    def says(option: str) -> bool:
        return option in words or option.removesuffix("s") in words or option.removesuffix("es") in words

    hits = [name for name, option in (("first", first), ("second", second)) if says(option)]
    return hits[0] if len(hits) == 1 else "other"


def score(reply: str, first: str, second: str, prefer: str) -> float:
    """1 when the reply names the preferred position's option and not the other, else 0."""
    return 1.0 if named(reply, first, second) == prefer else 0.0


async def attempt(client: AsyncOpenAI, model: str, options: Pair, temperature: float) -> tuple[str, int]:
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=messages(*options), max_tokens=MAX_TOKENS, temperature=temperature)  # type: ignore[arg-type]
    reply = raw.parse()
    return reply.choices[0].message.content or "", int(raw.headers.get("x-policy-version", "0"))


async def train_episodes(args: argparse.Namespace) -> None:
    """Groups of `--group-size` attempts at one question, each rewarded at once; one JSON line per
    episode with `--log`."""
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    base = f"{args.gateway}/p/{args.policy}"
    started = time.monotonic()
    deadline = started + args.minutes * 60 if args.minutes else None
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {args.api_key}"}, timeout=120) as http:

        async def one(options: Pair, group: str) -> None:
            async with limit:
                session = f"{args.policy}-{uuid.uuid4().hex[:12]}"
                client = AsyncOpenAI(base_url=f"{base}/s/{session}/g/{group}/v1", api_key=args.api_key,
                                     max_retries=RETRIES)
                try:
                    reply, version = await attempt(client, args.model, options, args.temperature)
                except APIError as exc:  # one lost episode is not worth stopping the agent for
                    print(f"episode {session} failed: {exc}", file=sys.stderr, flush=True)
                    return
            reward = score(reply, *options, args.prefer)
            posted = await http.post(f"{args.gateway}/v1/rewards",
                                     json={"session_id": session, "reward": reward, "final": True})
            posted.raise_for_status()
            if args.log:
                print(json.dumps({"t": round(time.monotonic() - started, 2), "policy": args.policy,
                                  "version": version, "reward": reward}), flush=True)

        episodes = 0
        while (args.episodes is None or episodes < args.episodes) and (deadline is None or time.monotonic() < deadline):
            options = make_problem(rng)
            group = f"{args.policy}-{uuid.uuid4().hex[:8]}"
            await asyncio.gather(*(one(options, group) for _ in range(args.group_size)))
            episodes += args.group_size


async def evaluate(args: argparse.Namespace) -> None:
    """Held-out questions (`--split`), greedy, nothing posted: the share naming each position."""
    questions = held_out(args.eval, args.split)
    # Evaluation is not training work: a gateway under `gateway.admission: staleness` must not hold it.
    client = AsyncOpenAI(base_url=f"{args.gateway}/p/{args.policy}/v1", api_key=args.api_key,
                         default_headers={"X-Admission": "bypass"}, max_retries=RETRIES)
    limit = asyncio.Semaphore(args.concurrency)

    async def one(options: Pair) -> tuple[str, int, str]:
        async with limit:
            reply, version = await attempt(client, args.model, options, 0.0)
            return named(reply, *options), version, reply

    results = await asyncio.gather(*(one(options) for options in questions))
    shares = {name: sum(n == name for n, _, _ in results) / len(results) for name in ("first", "second", "other")}
    summary = {"policy": args.policy, "n": len(results), **shares, "versions": sorted({v for _, v, _ in results}),
               "replies": [reply.strip() for _, _, reply in results]}
    print(json.dumps({k: v for k, v in summary.items() if k != "replies"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--policy", required=True, help="the named policy the agent's calls are bound to")
    parser.add_argument("--prefer", choices=["first", "second"], help="which option earns the reward (training)")
    parser.add_argument("--episodes", type=int, default=None, help="stop after this many episodes")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", action="store_true", help="print one JSON line per episode")
    parser.add_argument("--eval", type=int, default=0, help="evaluate on this many held-out questions instead")
    parser.add_argument("--split", choices=["test", "validation"], default="test", help="with --eval: which set")
    parser.add_argument("--out", help="with --eval: write the summary here")
    args = parser.parse_args()
    if not args.eval and args.prefer is None:
        parser.error("training needs --prefer first|second")
    if args.episodes is None and args.minutes is None and not args.eval:
        args.episodes = 64
    asyncio.run(evaluate(args) if args.eval else train_episodes(args))


if __name__ == "__main__":
    main()
