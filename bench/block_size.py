"""Part `block_size` of `bench.replicas`: vLLM's KV-cache block size on the CPU, and what it does to the
demo's generation (`engine.block_size`).

vLLM's prefix cache reuses whole blocks only. Its CPU default is 128 tokens, longer than the demo's 78-token
prompts, so nothing is ever reused: every attempt computes the shared instructions and worked examples
again, and each of a group's 8 attempts its whole prompt. Two servers run at once with the demo's settings
(float32, eager, 2 GiB of KV cache), one per block size, and every repetition sends the same traffic to
each in turn, the order rotated:

- `one group at a time`: the prefix cache emptied, as every publish empties it, then 4 groups of 8
  attempts at new training problems (temperature 1, 8 tokens), each group's 8 at once and one group after
  the other, as the demo agent sends them: one optimizer step's worth of generation;
- `4 groups at once`: the same 32 attempts sent together;
- greedy equivalence, once the timing is done: held-out problems answered greedily by both servers, the
  share of identical answers and the largest difference between their logprobs of a token both chose.

    python -m bench.replicas --parts block_size     # 128 (vLLM's CPU default) against 32, 5 repetitions
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import httpx

from bench.common import OUT_DIR, Part, ResultTable, console, provenance, run_started
from tracetrain.demo import arithmetic
from tracetrain.engines.models import smollm2_dir
from tracetrain.engines.vllm_server import VLLMServer, async_http_client

MODEL = "smollm2-135m-instruct"
GROUPS, GROUP_SIZE = 4, 8
"""A step of the demo: 32 sessions, 4 problems attempted 8 times each."""
SHAPES = ("one group at a time", "4 groups at once")


async def _attempt(client: httpx.AsyncClient, question: str, temperature: float) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": arithmetic.messages(question), "max_tokens": arithmetic.MAX_TOKENS,
        "temperature": temperature, "logprobs": True})
    response.raise_for_status()
    return response.json()["choices"][0]  # type: ignore[no-any-return]


async def _prefix_counts(client: httpx.AsyncClient) -> tuple[float, float]:
    """vLLM's running totals of prompt tokens looked up in the prefix cache, and of those found."""
    text = (await client.get("/metrics")).text

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


async def _step(client: httpx.AsyncClient, questions: Sequence[str], shape: str) -> dict[str, float]:
    """One step's generation in `shape` after an emptied prefix cache: seconds, and the share of prompt
    tokens the cache supplied."""
    (await client.post("/reset_prefix_cache")).raise_for_status()
    queries, hits = await _prefix_counts(client)
    started = time.perf_counter()
    if shape == SHAPES[0]:
        for q in questions:
            await asyncio.gather(*(_attempt(client, q, 1.0) for _ in range(GROUP_SIZE)))
    else:
        await asyncio.gather(*(_attempt(client, q, 1.0) for q in questions for _ in range(GROUP_SIZE)))
    seconds = time.perf_counter() - started
    queries_after, hits_after = await _prefix_counts(client)
    return {"seconds": seconds, "hit_share": (hits_after - hits) / max(queries_after - queries, 1.0)}


async def _greedy(client: httpx.AsyncClient, questions: Sequence[str]) -> list[tuple[str, list[tuple[str, float]]]]:
    answers = []
    for q in questions:  # one at a time, after the shared beginning is cached: a cached and an uncached pass
        choice = await _attempt(client, q, 0.0)
        tokens = [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]
        answers.append((choice["message"]["content"], tokens))
    return answers


async def measure(urls: dict[int, str], repetitions: int, eval_size: int) -> dict[str, Any]:
    clients = {size: async_http_client(url, timeout=300) for size, url in urls.items()}
    sizes = list(urls)
    runs: list[dict[str, Any]] = []
    rng = random.Random(0)
    for client in clients.values():  # warm-up: the first requests pay one-off costs
        await _step(client, [arithmetic.make_problem(rng)[0]], SHAPES[1])
    for rep in range(repetitions):
        questions = [arithmetic.make_problem(rng)[0] for _ in range(GROUPS)]
        order = sizes[rep % len(sizes):] + sizes[:rep % len(sizes)]
        for shape in SHAPES:
            for size in order:
                result = await _step(clients[size], questions, shape)
                runs.append({"repetition": rep, "block_size": size, "shape": shape, **result})
                console.print(f"  rep {rep} block {size:>3} {shape:<20} {result['seconds']:5.2f} s  "
                              f"prefix cache supplied {result['hit_share']:5.1%} of prompt tokens", highlight=False)
    questions = [q for q, _ in arithmetic.held_out(eval_size, "validation")]
    greedy = {size: await _greedy(clients[size], questions) for size in sizes}
    for client in clients.values():
        await client.aclose()
    reference, other = greedy[sizes[0]], greedy[sizes[-1]]
    same = sum(a[0] == b[0] for a, b in zip(reference, other, strict=True))
    gaps = [abs(x[1] - y[1]) for a, b in zip(reference, other, strict=True)
            for x, y in zip(a[1], b[1], strict=False) if x[0] == y[0]]
    return {"runs": runs, "greedy": {"problems": len(questions), "identical_answers": same,
                                     "max_logprob_gap": max(gaps, default=0.0),
                                     "mean_logprob_gap": statistics.fmean(gaps) if gaps else 0.0}}


def tables(raw: dict[str, Any], sizes: Sequence[int]) -> list[ResultTable]:
    table = ResultTable("seconds to generate one step's 32 attempts, mean (min-max) over repetitions",
                        ["block size", *[f"{shape}: s" for shape in SHAPES],
                         *[f"{shape}: prompt tokens from cache" for shape in SHAPES]])
    for size in sizes:
        cells, shares = [], []
        for shape in SHAPES:
            rows = [r for r in raw["runs"] if r["block_size"] == size and r["shape"] == shape]
            seconds = [r["seconds"] for r in rows]
            cells.append(f"{statistics.fmean(seconds):.2f} ({min(seconds):.2f}-{max(seconds):.2f})")
            shares.append(f"{statistics.fmean(r['hit_share'] for r in rows):.0%}")
        table.add(size, *cells, *shares)
    greedy = raw["greedy"]
    check = ResultTable(f"greedy answers to {greedy['problems']} validation problems, block {sizes[0]} against "
                        f"{sizes[-1]}", ["identical answers", "largest logprob gap", "mean logprob gap"])
    check.add(f"{greedy['identical_answers']}/{greedy['problems']}", f"{greedy['max_logprob_gap']:.2e}",
              f"{greedy['mean_logprob_gap']:.2e}")
    return [table, check]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[128, 32],
                        help="block_size part: the block sizes compared, the first the reference")
    parser.add_argument("--block-repetitions", type=int, default=5, help="block_size part: repetitions")
    parser.add_argument("--block-eval-size", type=int, default=32,
                        help="block_size part: validation problems of the greedy check")


def part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    logs = OUT_DIR / "replicas" / "block_size"
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        servers = {size: VLLMServer(smollm2_dir(), served_model_name=MODEL, block_size=size,
                                    log_path=logs / f"vllm-block{size}.log") for size in args.block_sizes}
        for server in servers.values():
            stack.callback(server.stop)
            server.launch()
        for server in servers.values():
            server.wait_healthy()
        console.print(f"vLLM up with block sizes {', '.join(map(str, servers))}; logs in {logs}")
        raw = asyncio.run(measure({size: s.url for size, s in servers.items()}, args.block_repetitions,
                                  args.block_eval_size))
    raw["block_sizes"] = args.block_sizes
    result = tables(raw, args.block_sizes)
    for table in result:
        console.print(table.rich())
    notes = [
        "Both servers run at once (2 GiB of KV cache each), idle but for the one measured; each repetition "
        "draws 4 new training problems and sends them to each server in turn, the first server rotating. A "
        "vLLM server keeps polling for a few seconds after its last request, so the one measured second shares "
        "the CPU for a while: the same for both sizes over the rotation.",
        "Each measurement starts with `/reset_prefix_cache`, as every publish of a new version does, so the "
        "first attempts of a step find nothing cached.",
        "`prompt tokens from cache`: vLLM's prefix-cache hits over its lookups during the measurement "
        "(`/metrics`).",
        "The greedy check runs the problems one at a time on each server: with 32-token blocks every answer after "
        "the first reads the shared beginning from the cache, with 128-token blocks none does.",
    ]
    return Part("block_size", command, provenance(started), result, notes, raw)
