"""A unit-conversion agent on the OpenAI Agents SDK (`openai-agents`), recorded by the gateway unchanged.

    python examples/agents/openai_agents/agent.py --gateway http://127.0.0.1:8000 --episodes 8
    python examples/agents/openai_agents/agent.py --api chat      # the SDK's Chat Completions model

Each episode asks how many centimetres are in some metres. The agent is a plain `agents.Agent` with a
`@function_tool`; its model is the SDK's own `OpenAIResponsesModel` (the default, `POST /v1/responses`)
or `OpenAIChatCompletionsModel`, on an `AsyncOpenAI` client whose base URL binds the session
(`…/s/{session}/g/{group}/v1`). The first model call must use the tool (`tool_choice`, enforced by
vLLM's constrained decoding; the SDK lets the model choose freely after that), the SDK runs it and the
model answers. The conversation only grows, so each episode is ONE trajectory. Reward: 1 when the
answer contains the right number, else 0, posted with `final: true`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
from agents import (
    Agent,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI's servers


@function_tool
def multiply(a: float, b: float) -> str:
    """Multiply two numbers."""
    value = a * b
    return str(int(value)) if value.is_integer() else str(value)


async def episode(args: argparse.Namespace, metres: int, group: str, http: httpx.AsyncClient) -> dict[str, Any]:
    session = f"agents-{uuid.uuid4().hex[:12]}"
    client = AsyncOpenAI(base_url=f"{args.gateway}/s/{session}/g/{group}/v1", api_key=args.api_key)
    model_class = OpenAIResponsesModel if args.api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="converter", instructions="Answer with a number. Use the multiply tool.",
                  model=model_class(model=args.model, openai_client=client), tools=[multiply],
                  model_settings=ModelSettings(temperature=args.temperature, max_tokens=128,
                                               tool_choice="multiply"))
    try:
        result = await Runner.run(agent, f"How many centimetres are in {metres} metres?", max_turns=3)
        text = str(result.final_output or "")
        tool_runs: int | None = sum(1 for item in result.new_items if item.type == "tool_call_output_item")
    except ModelBehaviorError as exc:  # a reply cut at max_tokens: the SDK refuses incomplete responses
        print(f"episode {session}: {exc}", flush=True)
        text, tool_runs = "", None
    numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text.replace(",", ""))]
    reward = 1.0 if metres * 100 in numbers else 0.0
    posted = await http.post(f"{args.gateway}/v1/rewards", json={"session_id": session, "reward": reward,
                                                                 "final": True})
    posted.raise_for_status()
    return {"session_id": session, "metres": metres, "answer": text, "reward": reward, "tool_runs": tool_runs}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {args.api_key}"}, timeout=600) as http:

        async def one(metres: int, group: str) -> dict[str, Any]:
            async with limit:
                return await episode(args, metres, group, http)

        jobs = []
        for start in range(0, args.episodes, args.group_size):
            metres = rng.randint(2, 40)
            jobs += [one(metres, f"agents-{args.seed}-{start}") for _ in range(min(args.group_size,
                                                                                  args.episodes - start))]
        results = await asyncio.gather(*jobs)
    print(f"episodes {len(results)}  mean reward {sum(r['reward'] for r in results) / len(results):.3f}", flush=True)
    return list(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api", choices=["responses", "chat"], default="responses")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write one JSON object per episode here")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
