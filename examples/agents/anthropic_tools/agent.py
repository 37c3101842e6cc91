"""A unit-conversion agent on the Anthropic SDK: a tool-use loop, recorded by the gateway unchanged.

    python examples/agents/anthropic_tools/agent.py --gateway http://127.0.0.1:8000 --episodes 8

Each episode asks how many centimetres are in some metres. The agent's client is the plain
`anthropic.AsyncAnthropic` with `base_url` pointing at `…/s/{session}/g/{group}` (what
`ANTHROPIC_BASE_URL` would be): the gateway serves `POST /v1/messages` there. The first turn forces
the `multiply` tool (`tool_choice: {"type": "tool"}`, enforced by vLLM's constrained decoding), the
agent runs it and sends back a `tool_result`; the model then answers in text (`tool_choice: none`).
The conversation only grows, so every episode is ONE trajectory. Reward: 1 when the answer contains
the right number, else 0, posted with `final: true` through the gateway's reward endpoint.
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

import anthropic
import httpx

MULTIPLY = {
    "name": "multiply",
    "description": "Multiply two numbers.",
    "input_schema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                     "required": ["a", "b"]},
}


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    if name != "multiply":
        return f"unknown tool {name}"
    try:
        value = float(arguments["a"]) * float(arguments["b"])
    except (KeyError, TypeError, ValueError):
        return "error: multiply needs numbers a and b"
    return str(int(value)) if value.is_integer() else str(value)


async def episode(args: argparse.Namespace, metres: int, group: str, http: httpx.AsyncClient) -> dict[str, Any]:
    session = f"units-{uuid.uuid4().hex[:12]}"
    client = anthropic.AsyncAnthropic(base_url=f"{args.gateway}/s/{session}/g/{group}", api_key=args.api_key)
    messages: list[Any] = [{"role": "user", "content": f"How many centimetres are in {metres} metres? "
                                                       "Use the multiply tool."}]
    sampling = {"temperature": args.temperature}  # the SDK takes sampling settings as extra body fields
    first = await client.messages.create(model=args.model, max_tokens=64, tools=[MULTIPLY], messages=messages,
                                         tool_choice={"type": "tool", "name": "multiply"}, extra_body=sampling)
    messages.append({"role": "assistant", "content": [block.model_dump() for block in first.content]})
    results = [{"type": "tool_result", "tool_use_id": block.id, "content": run_tool(block.name, block.input)}
               for block in first.content if block.type == "tool_use"]
    messages.append({"role": "user", "content": results or "Answer with a number."})
    answer = await client.messages.create(model=args.model, max_tokens=32, tools=[MULTIPLY], messages=messages,
                                          tool_choice={"type": "none"}, extra_body=sampling)
    text = "".join(block.text for block in answer.content if block.type == "text")
    numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text.replace(",", ""))]
    reward = 1.0 if metres * 100 in numbers else 0.0
    posted = await http.post(f"{args.gateway}/v1/rewards", json={"session_id": session, "reward": reward,
                                                                 "final": True})
    posted.raise_for_status()
    return {"session_id": session, "metres": metres, "answer": text, "reward": reward,
            "tool_calls": len(results), "message_ids": [first.id, answer.id]}


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
            jobs += [one(metres, f"units-{args.seed}-{start}") for _ in range(min(args.group_size,
                                                                                 args.episodes - start))]
        results = await asyncio.gather(*jobs)
    print(f"episodes {len(results)}  mean reward {sum(r['reward'] for r in results) / len(results):.3f}", flush=True)
    return list(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
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
