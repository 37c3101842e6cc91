"""The demo's agent: the OpenAI SDK, one sum per episode, a rule-based reward posted afterwards.

    python -m tracetrain.demo.arithmetic --gateway http://127.0.0.1:8000 --episodes 64
    python -m tracetrain.demo.arithmetic --eval 64 --out eval.json   # held-out, greedy, no rewards

It knows nothing about tracetrain beyond a base URL (which binds the session and the group) and the
reward endpoint. Each problem is attempted `--group-size` times in one group, so group baselines
(GRPO, RLOO) have something to compare.

**Traffic as production agents send it** (bench/learning_arms.py compares these): `--group-size 1
--no-group` attempts each problem once and names no group (the gateway then groups repeats of the same
prompt); `--reward-delay LO HI` posts each reward LO to HI seconds after its episode, so rewards arrive
late and out of order; `--reward-share P` rewards only that share of episodes (the rest never get one);
`--reward-flip P` flips that share of rewards (r -> 1 - r); `--reward exact` pays only an exact answer,
a task where most attempts of the base model earn nothing. `--until-version V` stops once a policy
version V or later has served an episode (a short run that sees one hot swap).

**The split.** Sums `a + b` with 1 <= a, b <= 30 are split once, by a fixed seed, on the *unordered*
pair {a, b}: `TEST` (the held-out set every figure is measured on), `VALIDATION` (for choosing
settings such as the learning rate) and `TRAIN` (everything training episodes draw from, in either
order). `a + b` and `b + a` are the same pair, so no held-out sum is ever asked during training, in
either order, whatever the run's seed.
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
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import APIError, AsyncOpenAI

SYSTEM = "You are a calculator. Reply with only the number."
EXAMPLES = [("What is 3 + 4?", "7"), ("What is 12 + 5?", "17")]
"""Two worked examples in the conversation: the format is shown, the sums are still the model's job.
Both are in `TRAIN` (see below), never in the held-out sets."""
MAX_TOKENS = 8
"""Answer-token cap of every attempt, training and evaluation alike (benchmarks use the same)."""
RETRIES = 20
"""Retries per request (429s while the trainer catches up, a reloading engine's 503s)."""

OPERANDS = range(1, 31)
SPLIT_SEED = 20_261_123
"""Fixed forever: changing it changes which sums are held out, and every earlier figure with it."""
TEST_SIZE, VALIDATION_SIZE = 96, 64
Pair = tuple[int, int]


def _split() -> tuple[list[Pair], list[Pair], list[Pair]]:
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS if a <= b]  # 465 unordered pairs
    shown = {(3, 4), (5, 12)}  # the worked examples stay out of the held-out sets
    candidates = [p for p in pairs if p not in shown]
    random.Random(SPLIT_SEED).shuffle(candidates)
    test = candidates[:TEST_SIZE]
    validation = candidates[TEST_SIZE : TEST_SIZE + VALIDATION_SIZE]
    train = sorted(candidates[TEST_SIZE + VALIDATION_SIZE :] + sorted(shown))
    return train, validation, test


TRAIN, VALIDATION, TEST = _split()
"""Unordered pairs (a <= b): 305 for training, 64 for validation, 96 held out."""


def _question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def make_problem(rng: random.Random) -> tuple[str, int, str]:
    """A training problem (question, answer, group id): a pair from `TRAIN`, in a random order."""
    a, b = rng.choice(TRAIN)
    if rng.random() < 0.5:
        a, b = b, a
    return _question(a, b), a + b, f"add-{a}-{b}"


def held_out(n: int, split: str = "test") -> list[tuple[str, int]]:
    """The first `n` problems of the held-out `test` (or `validation`) set, the same in every run; each
    pair is asked in one fixed order."""
    pool = {"test": TEST, "validation": VALIDATION}[split]
    if not 0 < n <= len(pool):
        raise ValueError(f"the {split} set has {len(pool)} problems; asked for {n}")
    order = random.Random(SPLIT_SEED + 1)
    problems = []
    for a, b in pool:
        if order.random() < 0.5:
            a, b = b, a
        problems.append((_question(a, b), a + b))
    return problems[:n]


def messages(question: str) -> list[dict[str, str]]:
    shots = [m for q, a in EXAMPLES for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": question}]


def exact_score(reply: str, answer: int) -> float:
    """1 for exactly the right number, else 0: no partial credit, so most groups of the base model fail
    together."""
    return 1.0 if reply.strip() == str(answer) else 0.0


@dataclass(frozen=True)
class RewardPlan:
    """What happens to one episode's reward: posted or not, when, and whether it is flipped. Drawn from
    the agent's seed before the episode runs, so the same seed gives the same plan in every arm."""

    post: bool
    delay_s: float
    flip: bool

    @classmethod
    def draw(cls, rng: random.Random, *, share: float, delay: tuple[float, float], flip: float) -> RewardPlan:
        post, delay_s, flipped = rng.random() < share, rng.uniform(*delay), rng.random() < flip
        return cls(post, delay_s, flipped)

    def reward(self, value: float) -> float:
        return round(1.0 - value, 4) if self.flip else value


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
        model=model, messages=messages(question), max_tokens=MAX_TOKENS, temperature=temperature)  # type: ignore[arg-type]
    reply = raw.parse()
    return reply.choices[0].message.content or "", int(raw.headers.get("x-policy-version", "0"))


async def train_episodes(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    plans = random.Random(args.seed + 1)  # its own stream: the problems stay those of the plain agent
    scorer = exact_score if args.reward == "exact" else score
    limit = asyncio.Semaphore(args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    done, total, started = 0, 0.0, time.monotonic()
    newest = 0  # the newest policy version an episode was served by
    deadline = started + args.minutes * 60 if args.minutes else None
    pending: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(headers=headers, timeout=120) as http:

        async def post_reward(session: str, reward: float, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            posted = await http.post(f"{args.gateway}/v1/rewards",
                                     json={"session_id": session, "reward": reward, "final": True})
            posted.raise_for_status()

        async def one(question: str, answer: int, group: str, plan: RewardPlan) -> None:
            nonlocal done, total, newest
            async with limit:
                session = f"arith-{uuid.uuid4().hex[:12]}"
                # A gateway under `gateway.admission: staleness` answers 429 with Retry-After while the trainer
                # catches up; the SDK waits that long and retries, as often as this allows.
                binding = f"/s/{session}" if args.no_group else f"/s/{session}/g/{group}"
                client = AsyncOpenAI(base_url=f"{args.gateway}{binding}/v1", api_key=args.api_key,
                                     max_retries=RETRIES)
                try:
                    reply, version = await attempt(client, args.model, question, args.temperature)
                except APIError as exc:  # one lost episode is not worth stopping the agent for
                    print(f"episode {session} failed: {exc}", file=sys.stderr, flush=True)
                    return
            reward = scorer(reply, answer)
            newest = max(newest, version)
            if plan.post:
                task = asyncio.create_task(post_reward(session, plan.reward(reward), plan.delay_s))
                pending.add(task)
                task.add_done_callback(pending.discard)
            done, total = done + 1, total + reward
            if args.log:  # the true reward, whatever the trainer is told
                print(json.dumps({"t": round(time.monotonic() - started, 2), "version": version,
                                  "reward": reward, "posted": plan.post}), flush=True)
            elif done % 16 == 0:
                print(f"episodes {done}  mean reward {total / done:.3f}  "
                      f"({done / (time.monotonic() - started):.2f} episodes/s)", flush=True)

        episode = 0
        while ((args.episodes is None or episode < args.episodes) and (deadline is None or time.monotonic() < deadline)
               and (args.until_version is None or newest < args.until_version)):
            question, answer, group = make_problem(rng)
            draws = [RewardPlan.draw(plans, share=args.reward_share, delay=args.reward_delay, flip=args.reward_flip)
                     for _ in range(args.group_size)]
            await asyncio.gather(*(one(question, answer, group, plan) for plan in draws))
            episode += args.group_size
        await asyncio.gather(*pending)  # late rewards still due are posted before the agent ends


async def evaluate(args: argparse.Namespace) -> None:
    """Held-out problems (`--split`, never drawn for training), greedy, nothing posted."""
    problems = held_out(args.eval, args.split)
    # Evaluation is not training work: a gateway under `gateway.admission: staleness` must not hold it.
    client = AsyncOpenAI(base_url=f"{args.gateway}/v1", api_key=args.api_key, default_headers={"X-Admission": "bypass"})
    limit = asyncio.Semaphore(args.concurrency)

    async def one(question: str, answer: int) -> tuple[float, int, str]:
        async with limit:
            reply, version = await attempt(client, args.model, question, 0.0)
            return score(reply, answer), version, reply

    results = await asyncio.gather(*(one(q, a) for q, a in problems))
    rewards = [r for r, _, _ in results]
    replies = [reply.strip() for _, _, reply in results]
    summary = {"mean_reward": sum(rewards) / len(rewards), "n": len(rewards),
               "exact": sum(r == 1.0 for r in rewards) / len(rewards),
               "versions": sorted({v for _, v, _ in results}),
               # A policy that answers the same few numbers whatever the question has stopped reading it.
               "distinct_replies": len(set(replies)), "replies": replies}
    print(json.dumps({k: v for k, v in summary.items() if k != "replies"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary))


def agent_parser(description: str | None) -> argparse.ArgumentParser:
    """The flags every demo agent shares (this one and tracetrain.demo.tool_agent): where the gateway is, when
    to stop, how its traffic is shaped (groups; rewards late, for a share, flipped), its sampling, and the
    held-out evaluation. The agent adds its task's own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=None, help="stop after this many episodes")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--no-group", action="store_true",
                        help="name no group in the URL (the gateway groups repeats of a prompt itself)")
    parser.add_argument("--reward-delay", type=float, nargs=2, default=(0.0, 0.0), metavar=("LO", "HI"),
                        help="post each reward this many seconds after its episode, drawn uniformly")
    parser.add_argument("--reward-share", type=float, default=1.0, help="share of episodes that get a reward")
    parser.add_argument("--reward-flip", type=float, default=0.0, help="share of posted rewards flipped")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", action="store_true", help="print one JSON line per episode")
    parser.add_argument("--eval", type=int, default=0, help="evaluate on this many held-out problems instead")
    parser.add_argument("--split", choices=["test", "validation"], default="test",
                        help="with --eval: which held-out set")
    parser.add_argument("--out", help="with --eval: write the summary here")
    return parser


def check_agent_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse shares outside [0, 1] and a delay range upside down, as argparse refuses a bad flag."""
    if not 0.0 <= args.reward_share <= 1.0 or not 0.0 <= args.reward_flip <= 1.0:
        parser.error("--reward-share and --reward-flip are shares between 0 and 1")
    if not 0.0 <= args.reward_delay[0] <= args.reward_delay[1]:
        parser.error("--reward-delay takes LO HI with 0 <= LO <= HI")


def main() -> None:
    parser = agent_parser(__doc__)
    parser.add_argument("--until-version", type=int, default=None, metavar="V",
                        help="stop after the first group with an episode served by policy version V or later")
    parser.add_argument("--reward", choices=["partial", "exact"], default="partial",
                        help="partial credit for a close number (default), or only an exact answer")
    args = parser.parse_args()
    check_agent_arguments(parser, args)
    if args.episodes is None and args.minutes is None and args.until_version is None and not args.eval:
        args.episodes = 64
    asyncio.run(evaluate(args) if args.eval else train_episodes(args))


if __name__ == "__main__":
    main()
