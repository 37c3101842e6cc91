"""The multi-turn demo agent: a LangChain tool agent, unchanged, that adds numbers with a tool over several
turns and is rewarded once, at the end.

    python -m tracetrain.demo.tool_agent --gateway http://127.0.0.1:8000 --episodes 64
    python -m tracetrain.demo.tool_agent --eval 64 --split validation --out eval.json   # held-out, greedy

An episode asks "Add up 12, 7 and 25." with one tool, `add(a, b)`. Every turn but the last is a forced tool
call (`tool_choice="required"`: the gateway constrains the call's JSON, the model chooses the arguments);
the tool runs on whatever the model passed, and its result goes back as a tool message; the last turn
answers in text (`tool_choice="none"`). With `--operands 2` (the default) that is two turns, with 3 three.
One reward per episode, posted after it ends, scored on the answer alone: with `--reward correct` (the
default), 1 when its first number is the total, else 0; with `--reward partial`, as the arithmetic demo
scores it, 1 for a reply that is just the total and up to 0.5 for how close its first number is. Either
way the answer depends on every turn (arguments copied wrongly in the first turn make every later sum
wrong), so credit for the answer must reach the first turn's tokens. The defaults are the task chosen on
the validation split (bench/learning_arms.py): the one with the most turns whose right answers rose.

The held-out evaluation always scores with partial credit, as the arithmetic demo's does, whatever the
training reward, and reports beside it the share of right answers (`correct`) and of episodes whose tool
turns reached the total (`tools_reached_total`).

The agent is ordinary LangChain (`ChatOpenAI.bind_tools`, `ToolMessage`), bound to a gateway session by
its base URL (`tracetrain.adapters.langchain`); nothing in it knows about training.

**The split**, as in `tracetrain.demo.arithmetic`: the operand sets are split once by a fixed seed on the
*unordered* set, into `TEST` (the held-out set), `VALIDATION` (for choosing settings) and `TRAIN`; training
asks its sets in random orders, the held-out sets in one fixed order. Two operands use the arithmetic
demo's pairs; three use multisets of 1..30.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from openai import APIError

from tracetrain.adapters.langchain import LangChainSession
from tracetrain.demo import arithmetic
from tracetrain.demo.arithmetic import RETRIES, RewardPlan

SYSTEM = "You add numbers with the add tool, two at a time. Then reply with only the total."
CALL_TOKENS = 40
"""Token cap of a tool-call turn: the constrained call `{"name": "add", "arguments": {"a": .., "b": ..}}`."""
ANSWER_TOKENS = 8
"""Token cap of the answering turn, as the arithmetic demo's answers."""

SPLIT_SEED = 20_261_127
"""Fixed forever for three operands (two use `arithmetic`'s split): it decides which sets are held out."""
TEST_SIZE, VALIDATION_SIZE = 96, 64
DEFAULT_OPERANDS = 2
"""`--operands` unless given: the task chosen on the validation split (see the module's docstring)."""
Operands = tuple[int, ...]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _split_triples() -> tuple[list[Operands], list[Operands], list[Operands]]:
    ops = arithmetic.OPERANDS
    triples: list[Operands] = [(a, b, c) for a in ops for b in ops if a <= b for c in ops if b <= c]
    random.Random(SPLIT_SEED).shuffle(triples)
    test, validation = triples[:TEST_SIZE], triples[TEST_SIZE:TEST_SIZE + VALIDATION_SIZE]
    return sorted(triples[TEST_SIZE + VALIDATION_SIZE:]), validation, test


SPLITS: dict[int, tuple[list[Operands], list[Operands], list[Operands]]] = {
    2: (list(arithmetic.TRAIN), list(arithmetic.VALIDATION), list(arithmetic.TEST)),
    3: _split_triples(),
}
"""(train, validation, test) unordered operand sets, by how many operands a problem has."""


def question(operands: Operands) -> str:
    *first, last = operands
    return f"Add up {', '.join(map(str, first))} and {last}."


def make_problem(rng: random.Random, count: int) -> tuple[Operands, str]:
    """A training problem (operands in the order asked, group id): a set from the training split, shuffled."""
    operands = list(rng.choice(SPLITS[count][0]))
    rng.shuffle(operands)
    return tuple(operands), "tools-" + "-".join(map(str, operands))


def held_out(n: int, count: int, split: str = "test") -> list[Operands]:
    """The first `n` held-out problems of `split`, each set in one fixed order, the same in every run."""
    pool = SPLITS[count][{"validation": 1, "test": 2}[split]]
    if not 0 < n <= len(pool):
        raise ValueError(f"the {split} set of {count} operands has {len(pool)} problems; asked for {n}")
    order = random.Random(SPLIT_SEED + count)
    problems = []
    for operands in pool[:n]:
        shuffled = list(operands)
        order.shuffle(shuffled)
        problems.append(tuple(shuffled))
    return problems


def correct(reply: str, total: int) -> float:
    """1 when the reply's first number is the total, else 0."""
    numbers = re.findall(r"-?\d+", reply)
    return 1.0 if numbers and int(numbers[0]) == total else 0.0


def tools_reached(conversation: list[BaseMessage], total: int) -> bool:
    """Whether the tool turns got the total: the last tool result is it, so the answer had only to copy it.
    Held apart from the answer's score, it shows which turns an episode got right."""
    results = [m for m in conversation if isinstance(m, ToolMessage)]
    return bool(results) and str(results[-1].content).strip() == str(total)


REWARDS: dict[str, Callable[[str, int], float]] = {"partial": arithmetic.score, "correct": correct}
"""`--reward`: how an episode's answer is scored against the total."""


async def episode(session: LangChainSession, model: str, operands: Operands, temperature: float,
                  headers: dict[str, str] | None = None) -> tuple[str, list[BaseMessage]]:
    """Run one episode in `session`: the forced tool calls, then the answer. Returns the answer's text and
    the conversation."""
    llm = session.chat_model(model, temperature=temperature, max_retries=RETRIES, default_headers=headers)
    call = llm.bind_tools([add], tool_choice="required").bind(max_tokens=CALL_TOKENS)
    answer = llm.bind_tools([add], tool_choice="none").bind(max_tokens=ANSWER_TOKENS)
    conversation: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question(operands))]
    for _ in range(len(operands) - 1):
        turn = await call.ainvoke(conversation)
        assert isinstance(turn, AIMessage)
        conversation.append(turn)
        for requested in turn.tool_calls:
            try:
                result: Any = await add.ainvoke(requested["args"])
            except Exception as exc:  # arguments the tool cannot take: the agent reports it and goes on
                result = f"error: {exc}"
            conversation.append(ToolMessage(str(result), tool_call_id=requested["id"] or ""))
    final = await answer.ainvoke(conversation)
    conversation.append(final)
    return str(final.content), conversation


async def served_version(session: LangChainSession) -> int:
    """The newest policy version among the session's calls, as the gateway recorded them."""
    response = await session.ahttp.get(f"/v1/sessions/{session.session_id}")
    response.raise_for_status()
    return max((int(c.get("policy_version", 0)) for c in response.json().get("calls", [])), default=0)


async def train_episodes(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    plans = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.concurrency)
    done, total, started = 0, 0.0, time.monotonic()
    deadline = started + args.minutes * 60 if args.minutes else None
    pending: set[asyncio.Task[None]] = set()

    async def one(operands: Operands, group: str, plan: RewardPlan) -> None:
        nonlocal done, total
        async with limit:
            session = LangChainSession(args.gateway, session_id=f"tools-{uuid.uuid4().hex[:12]}",
                                       group_id=None if args.no_group else group, api_key=args.api_key)
            try:
                reply, _ = await episode(session, args.model, operands, args.temperature)
                version = await served_version(session)
            except APIError as exc:  # one lost episode is not worth stopping the agent for
                print(f"episode {session.session_id} failed: {exc}", file=sys.stderr, flush=True)
                await session.aclose()
                return
        reward = REWARDS[args.reward](reply, sum(operands))
        if plan.post:
            task = asyncio.create_task(post_reward(session, plan.reward(reward), plan.delay_s))
            pending.add(task)
            task.add_done_callback(pending.discard)
        else:
            await session.aclose()
        done, total = done + 1, total + reward
        if args.log:  # the true reward, whatever the trainer is told
            print(json.dumps({"t": round(time.monotonic() - started, 2), "version": version, "reward": reward,
                              "posted": plan.post}), flush=True)
        elif done % 16 == 0:
            print(f"episodes {done}  success {total / done:.3f}  "
                  f"({done / (time.monotonic() - started):.2f} episodes/s)", flush=True)

    async def post_reward(session: LangChainSession, reward: float, delay_s: float) -> None:
        try:
            await asyncio.sleep(delay_s)
            await session.areward(reward)
        finally:
            await session.aclose()

    sent = 0
    while (args.episodes is None or sent < args.episodes) and (deadline is None or time.monotonic() < deadline):
        operands, group = make_problem(rng, args.operands)
        draws = [RewardPlan.draw(plans, share=args.reward_share, delay=args.reward_delay, flip=args.reward_flip)
                 for _ in range(args.group_size)]
        await asyncio.gather(*(one(operands, group, plan) for plan in draws))
        sent += args.group_size
    await asyncio.gather(*pending)


async def evaluate(args: argparse.Namespace) -> None:
    """Held-out problems (`--split`, never drawn for training), greedy, nothing posted."""
    problems = held_out(args.eval, args.operands, args.split)
    limit = asyncio.Semaphore(args.concurrency)
    bypass = {"X-Admission": "bypass"}  # evaluation is not training work: admission must not hold it

    reached: list[bool] = []

    async def one(operands: Operands) -> tuple[float, int, str]:
        async with limit, LangChainSession(args.gateway, session_id=f"tools-eval-{uuid.uuid4().hex[:12]}",
                                    api_key=args.api_key) as session:
            reply, conversation = await episode(session, args.model, operands, 0.0, bypass)
            reached.append(tools_reached(conversation, sum(operands)))
            return arithmetic.score(reply, sum(operands)), await served_version(session), reply

    results = await asyncio.gather(*(one(p) for p in problems))
    rewards = [r for r, _, _ in results]
    replies = [reply.strip() for _, _, reply in results]
    right = [correct(reply, sum(p)) for p, (_, _, reply) in zip(problems, results, strict=True)]
    summary = {"mean_reward": sum(rewards) / len(rewards), "n": len(rewards),
               "exact": sum(r == 1.0 for r in rewards) / len(rewards), "correct": sum(right) / len(right),
               "tools_reached_total": sum(reached) / len(reached),
               "reward": "partial",
               "versions": sorted({v for _, v, _ in results}), "operands": args.operands,
               "distinct_replies": len(set(replies)), "replies": replies}
    print(json.dumps({k: v for k, v in summary.items() if k != "replies"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary))


def main(argv: list[str] | None = None) -> None:
    parser = arithmetic.agent_parser(__doc__)
    parser.add_argument("--operands", type=int, choices=sorted(SPLITS), default=DEFAULT_OPERANDS,
                        help="numbers per problem: one forced tool call per number after the first, then the answer")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="correct",
                        help="1 only when the answer's first number is right (default), or partial credit for a close "
                        "answer (training only: the evaluation always gives partial credit)")
    args = parser.parse_args(argv)
    arithmetic.check_agent_arguments(parser, args)
    if args.episodes is None and args.minutes is None and not args.eval:
        args.episodes = 64
    asyncio.run(evaluate(args) if args.eval else train_episodes(args))


if __name__ == "__main__":
    main()
