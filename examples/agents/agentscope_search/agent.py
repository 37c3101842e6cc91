"""Search agent: AgentScope 2's `Agent` with a local search tool, a rule-based reward posted afterwards.

    python examples/agents/agentscope_search/agent.py --gateway http://127.0.0.1:8000 --episodes 32

A plain AgentScope agent (`Agent`, `Toolkit`, a `FunctionTool`): asked a question, the model searches a
small in-file corpus of facts, reads the passages the tool returns and answers; the reward is 1 when the
answer contains the expected fact, else 0. Every call of an episode is one gateway session, one
token-exact trajectory. tracetrain appears only as `AgentScopeSession` (the model's base URL, the reward,
the completion ids) and the `ForceToolChoice` middleware: the first reasoning step names the tool
(`--first-tool-choice search`), which a vLLM-backed gateway enforces by constrained decoding, so even a
135M model makes a well-formed call; `auto` leaves it to the model (the in-process engine refuses forced
tool choices). Each question is attempted `--group-size` times in one group, so group baselines (GRPO,
RLOO) have something to compare. The model streams, as AgentScope's models do by default (`--no-stream`
turns it off); the recorded tokens are the same either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path
from typing import Annotated

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.message import TextBlock, UserMsg
from agentscope.middleware import MiddlewareBase
from agentscope.model import OpenAIChatModel
from agentscope.tool import FunctionTool, ToolChunk, Toolkit
from pydantic import Field

from tracetrain.adapters.agentscope import AgentScopeSession, ForceToolChoice

SYSTEM = "You answer questions. Use the search tool to look facts up, then answer in one short sentence."
CORPUS = [
    "Dune is a science fiction novel written by Frank Herbert and published in 1965.",
    "The Eiffel Tower in Paris was completed in 1889 for the World's Fair.",
    "Mount Everest, the highest mountain on Earth, is 8849 metres tall.",
    "The chemical symbol of gold is Au, from the Latin word aurum.",
    "The Pacific Ocean is the largest and deepest ocean on Earth.",
    "Marie Curie won Nobel Prizes in both physics and chemistry.",
    "The planet Mars has two small moons, Phobos and Deimos.",
    "Canberra is the capital city of Australia.",
    "The Great Wall of China is more than 21000 kilometres long.",
    "Penicillin was discovered by Alexander Fleming in 1928.",
]
QUESTIONS = [  # (question, the fact the answer must contain)
    ("Who wrote the novel Dune?", "Frank Herbert"),
    ("In which year was the Eiffel Tower completed?", "1889"),
    ("How tall is Mount Everest in metres?", "8849"),
    ("What is the chemical symbol of gold?", "Au"),
    ("Which is the largest ocean on Earth?", "Pacific"),
    ("What is the capital city of Australia?", "Canberra"),
    ("What are the names of the moons of Mars?", "Phobos"),
    ("Who discovered penicillin?", "Alexander Fleming"),
]
STOPWORDS = {"a", "an", "the", "of", "in", "on", "is", "was", "what", "which", "who", "how", "are", "and", "for",
             "by", "to", "with", "from", "names", "does", "did", "year"}


def _terms(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS}


def search(query: Annotated[str, Field(max_length=60)]) -> ToolChunk:
    """Search the encyclopedia for passages about a topic.

    Args:
        query (str): Keywords describing what to look up, e.g. "capital of France".
    """
    wanted = _terms(query)
    scored = sorted(((len(wanted & _terms(p)), p) for p in CORPUS), key=lambda s: -s[0])
    hits = [passage for score, passage in scored[:2] if score > 0]
    return ToolChunk(content=[TextBlock(text="\n".join(hits) or "No passage found.")])


def score(answer: str, fact: str) -> float:
    """1 when the final answer contains the expected fact (case-insensitive, as a whole word), else 0."""
    return 1.0 if re.search(rf"\b{re.escape(fact.lower())}\b", answer.lower()) else 0.0


def make_agent(session: AgentScopeSession, args: argparse.Namespace) -> Agent:
    """A fresh agent per episode (its state is the episode's conversation), its model bound to `session`.

    The tool is read-only, so AgentScope's permission engine runs it without asking a user. AgentScope's
    runtime-state hint (the wall-clock time, appended before the first reasoning step) is off: it is
    noise to a 135M model, and it would make the prompts of one group differ.
    """
    toolkit = Toolkit(tools=[FunctionTool(search, is_read_only=True)])
    model = session.chat_model(args.model, stream=args.stream, parameters=OpenAIChatModel.Parameters(
        temperature=args.temperature, max_tokens=args.max_tokens))
    middlewares: list[MiddlewareBase] = [session.middleware]
    if args.first_tool_choice != "auto":
        middlewares.append(ForceToolChoice(args.first_tool_choice))
    return Agent(name="assistant", system_prompt=SYSTEM, model=model, toolkit=toolkit, middlewares=middlewares,
                 react_config=ReActConfig(max_iters=args.max_iters),
                 injection_config=InjectionConfig(inject_runtime_state=False))


async def run(args: argparse.Namespace) -> list[dict[str, object]]:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    results: list[dict[str, object]] = []
    rewards: list[float] = []
    started = time.monotonic()

    async def one(question: str, fact: str, group: str) -> None:
        async with limit, AgentScopeSession(args.gateway, group_id=group, api_key=args.api_key) as session:
            reply = await make_agent(session, args).reply(UserMsg("user", question))
            answer = reply.get_text_content() or ""
            reward = score(answer, fact)
            await session.areward(reward)
            rewards.append(reward)
            results.append({"session_id": session.session_id, "question": question, "fact": fact,
                            "answer": answer, "reward": reward, "completion_ids": session.completion_ids})
            done = len(rewards)
            if args.verbose:
                print(f"{question} -> {answer!r}  reward {reward}  ({session.session_id})", flush=True)
            elif done % 8 == 0:
                print(f"episodes {done}  mean reward {sum(rewards) / done:.3f}  "
                      f"({done / (time.monotonic() - started):.2f} episodes/s)", flush=True)

    count = 0
    while count < args.episodes:
        question, fact = rng.choice(QUESTIONS)
        size = min(args.group_size, args.episodes - count)
        group = "search-" + "-".join(sorted(_terms(question)))
        await asyncio.gather(*(one(question, fact, group) for _ in range(size)))
        count += size
    print(f"done: {len(rewards)} episodes, mean reward {sum(rewards) / max(len(rewards), 1):.3f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-iters", type=int, default=3, help="reasoning-acting steps before the agent summarizes")
    parser.add_argument("--first-tool-choice", default="search", choices=["search", "required", "auto"],
                        help="tool_choice of the first reasoning step (forced choices need a vLLM engine)")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="non-streamed model calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print every episode")
    parser.add_argument("--out", help="write one JSON object per episode here")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
