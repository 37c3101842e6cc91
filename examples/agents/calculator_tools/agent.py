"""Calculator agent: LangChain with a calculator tool, multi-turn, a rule-based reward posted afterwards.

    python examples/agents/calculator_tools/agent.py --gateway http://127.0.0.1:8000 --episodes 32

A plain LangChain tool loop (`@tool`, `bind_tools`, `ToolMessage`): the model calls the calculator,
reads its result and answers; every call of an episode is one gateway session, one token-exact
trajectory. tracetrain appears only as `LangChainSession` (the session's base URL and the reward).
The first turn names the tool (`tool_choice="calculator"`), which a vLLM-backed gateway enforces by
constrained decoding, so even a 135M model makes a well-formed call; `--first-tool-choice auto` leaves
it to the model (the in-process engine refuses forced tool choices). Each problem is attempted
`--group-size` times in one group, so group baselines (GRPO, RLOO) have something to compare.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import operator
import random
import re
import time
from collections.abc import Callable
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool

from tracetrain.adapters.langchain import LangChainSession

SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic, then state the result."
OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "add": ("+", operator.add), "sub": ("-", operator.sub), "mul": ("*", operator.mul)}
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    """Numbers and + - * / // % only (no names, calls or powers): the model's input is untrusted."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))  # type: ignore[no-any-return]
    raise ValueError("only numbers and + - * / // % are allowed")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as "17 * 23" and return the result."""
    try:
        value = _evaluate(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError) as error:
        return f"error: {error}"
    return str(value) if isinstance(value, int) or not value.is_integer() else str(int(value))


def make_problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, group id)."""
    name = rng.choice(list(OPS))
    symbol, apply = OPS[name]
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"What is {a} {symbol} {b}?", apply(a, b), f"calc-{name}-{a}-{b}"


def score(reply: str | None, answer: int) -> float:
    """1 when the last number of the final answer is right; otherwise up to 0.5 for how close it is;
    0 with no final answer (the episode ran out of turns) or no number in it."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", reply or "")
    if not numbers:
        return 0.0
    value = float(numbers[-1])
    if value == answer:
        return 1.0
    return round(0.5 * max(0.0, 1.0 - abs(value - answer) / max(abs(answer), 1)), 4)


async def episode(session: LangChainSession, args: argparse.Namespace, question: str) -> str | None:
    """The tool loop: call the model; run the tools it asks for; stop at a plain answer."""
    llm = session.chat_model(args.model, temperature=args.temperature, max_tokens=args.max_tokens)
    first = llm.bind_tools([calculator], tool_choice=args.first_tool_choice)
    free = llm.bind_tools([calculator])
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question)]
    for turn in range(args.max_turns):
        reply = await (first if turn == 0 else free).ainvoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        if not reply.tool_calls:
            return reply.text
        for call in reply.tool_calls:
            messages.append(await calculator.ainvoke(call))  # a ToolMessage with the call's id
    return None


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    done, total, exact, started = 0, 0.0, 0, time.monotonic()

    async def one(question: str, answer: int, group: str) -> None:
        nonlocal done, total, exact
        async with limit, LangChainSession(args.gateway, group_id=group, api_key=args.api_key) as session:
            final = await episode(session, args, question)
            reward = score(final, answer)
            await session.areward(reward)
            done, total, exact = done + 1, total + reward, exact + (reward == 1.0)
            if args.verbose:
                print(f"{question} -> {final!r}  reward {reward}  ({session.session_id})", flush=True)
            elif done % 8 == 0:
                print(f"episodes {done}  mean reward {total / done:.3f}  exact {exact / done:.2f}  "
                      f"({done / (time.monotonic() - started):.2f} episodes/s)", flush=True)

    count = 0
    while count < args.episodes:
        question, answer, group = make_problem(rng)
        size = min(args.group_size, args.episodes - count)
        await asyncio.gather(*(one(question, answer, group) for _ in range(size)))
        count += size
    print(f"done: {done} episodes, mean reward {total / max(done, 1):.3f}, exact {exact / max(done, 1):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--first-tool-choice", default="calculator", choices=["calculator", "required", "auto"],
                        help="tool_choice of the first turn (forced choices need a vLLM engine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print every episode")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
