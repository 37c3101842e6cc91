"""vLLM serving behind the gateway on the CPU, in two parts. `routing`: one vs two replicas, session
affinity vs round-robin, and failover when a replica is SIGKILLed under load. `block_size`: vLLM's KV-cache
block size and the demo's generation (bench/block_size.py says how).

    python -m bench.replicas                                  # both parts
    python -m bench.replicas --parts routing --seconds 30 --repeats 1 --no-failover
    python -m bench.replicas --parts routing --system-words 20 --tool-words 120 --turns 8 --no-failover
    python -m bench.replicas --parts block_size               # 128 (vLLM's CPU default) against 32

Part `routing`:

Routing arms (each a fresh `tracetrain serve` with its own SQLite store, in front of the same two vLLM
servers, run in rotated order, `--repeats` times): `1 replica`, `2 replicas sticky` (the default
routing), `2 replicas round-robin` (`engine.routing: round_robin`, no affinity). The workload is
fixed before the runs: `--agents` concurrent agents, each running sessions of `--turns` turns; every
session opens with its own system prompt (unique, so only a session's own earlier turns can be
cached; `--system-words`, default ~300 tokens) and its history grows turn by turn (by `--tool-words`
of tool result per turn in the agent-like variant); 16 sampled tokens per call, temperature 1. Per arm:
calls/s, p50/p99 latency, and vLLM's own prefix-cache hit rate over the arm (hits / queried tokens,
`vllm:prefix_cache_*` counters summed over the replicas).

Failover (once, after the routing arms): `tracetrain serve --replicas 2` starts its own two servers;
under the same load one of them is SIGKILLed (its whole process group); reported: calls answered,
calls failed (5xx), calls lost (answered but not in the store: must be 0), and the time until the
killed replica serves again (the set restarts it and catches it up). Placement: each replica's OpenMP
threads are bound to a core of its own (`replica_placement`, what `serve --replicas` does); a single
vLLM CPU server binds one core by itself and leaves the other to the API processes, so `1 replica`
computes on one core and `2 replicas` on both, while the gateway, the API servers and this load
generator share them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlmodel import Session, select

from bench import block_size
from bench.common import (
    OUT_DIR,
    Part,
    ResultTable,
    ServerProcess,
    add_results_dir_argument,
    command_line,
    console,
    free_port,
    parts_parser,
    percentile,
    provenance,
    python_cmd,
    run_parts,
    run_started,
)

MODEL = "smollm2"
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa"]


@dataclass
class Load:
    latencies: list[float] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)
    failed: int = 0
    other: int = 0
    elapsed: float = 0.0


def system_prompt(rng: random.Random, session: str, words: int) -> str:
    context = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Session {session}. You are a terse assistant. Context: {context}."


def user_turn(rng: random.Random, turn: int, tool_words: int) -> str:
    """A user turn; with `tool_words`, it carries a tool result first, as agent loops do."""
    ask = f"Turn {turn}: say {rng.choice(WORDS)}."
    if not tool_words:
        return ask
    return f"Tool result: {' '.join(rng.choice(WORDS) for _ in range(tool_words))}\n{ask}"


async def agent(client: httpx.AsyncClient, url: str, n: int, args: argparse.Namespace, stop: asyncio.Event,
                load: Load, seed: int) -> None:
    rng = random.Random(seed * 1000 + n)
    s = 0
    while not stop.is_set():
        session = f"a{n}-s{s}-{seed}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt(rng, session, args.system_words)}]
        for turn in range(args.turns):
            if stop.is_set():
                return
            messages.append({"role": "user", "content": user_turn(rng, turn, args.tool_words)})
            started = time.perf_counter()
            try:
                response = await client.post(f"{url}/s/{session}/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 1.0})
            except httpx.HTTPError:
                load.other += 1
                break
            if response.status_code != 200:
                load.failed += response.status_code >= 500
                load.other += response.status_code < 500
                break
            load.latencies.append(time.perf_counter() - started)
            body = response.json()
            load.answered.append(body["id"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
        s += 1


async def run_load(url: str, args: argparse.Namespace, seed: int, during: Any = None) -> Load:
    load = Load()
    stop = asyncio.Event()
    seconds = args.seconds
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(agent(client, url, n, args, stop, load, seed)) for n in range(args.agents)]
        started = time.perf_counter()
        if during is not None:
            await during()
        remaining = seconds - (time.perf_counter() - started)
        await asyncio.sleep(max(0.0, remaining))
        stop.set()
        await asyncio.gather(*tasks)
        load.elapsed = time.perf_counter() - started
    return load


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the servers' Prometheus counters."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def start_gateway(name: str, options: list[str]) -> tuple[ServerProcess, str]:
    port = free_port()
    db = OUT_DIR / f"replicas-{name}-{port}.db"
    cmd = python_cmd("-m", "tracetrain.cli", "serve", "--engine", "vllm", "--served-model-name", MODEL,
                     "--port", str(port), "--db-url", f"sqlite:///{db}", *options)
    server = ServerProcess(f"gateway {name}", cmd, f"http://127.0.0.1:{port}")
    return server.start(timeout=900), f"sqlite:///{db}"


def stored_ids(db_url: str) -> set[str]:
    from tracetrain.store.db import connect_db
    from tracetrain.store.models import Call

    with Session(connect_db(db_url)) as db:
        return set(db.exec(select(Call.completion_id)).all())


def vllm_pid(port: int) -> int:
    """The vLLM API server listening on `port` (its process leads its group)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in args and str(port).encode() in args:
            return int(entry.name)
    raise RuntimeError(f"no vLLM API server on port {port}")


ARMS = {"1 replica": 1, "2 replicas sticky": 2, "2 replicas round-robin": 2}


def routing_arms(args: argparse.Namespace, table: ResultTable) -> dict[str, list[dict[str, float]]]:
    from tracetrain.engines.models import smollm2_dir
    from tracetrain.engines.vllm_server import VLLMServer, replica_placement

    # Placed as `serve --replicas 2` places them: each server's OpenMP threads on its own core.
    # Over TCP: this bench reads each server's own /metrics (prefix-cache counters) by URL.
    servers = [VLLMServer(smollm2_dir(), served_model_name=MODEL, max_model_len=4096, kv_cache_gib=1, listen="tcp",
                          log_path=OUT_DIR / f"replicas-vllm-{i}.log", env=replica_placement(i, 2))
               for i in range(2)]
    for server in servers:
        server.launch()
    try:
        for server in servers:
            server.wait_healthy()
        results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        names = list(ARMS)
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for arm in order:
                urls = [s.url for s in servers[: ARMS[arm]]]
                options = [x for url in urls for x in ("--engine-url", url)]
                if "round-robin" in arm:
                    options += ["--set", "engine.routing=round_robin"]
                console.rule(f"repeat {repeat}: {arm}")
                gateway, _ = start_gateway(arm.replace(" ", "-"), options)
                try:
                    before = prefix_counters(urls)
                    load = asyncio.run(run_load(gateway.url, args, repeat))
                    after = prefix_counters(urls)
                finally:
                    gateway.stop()
                hit_rate = (after[0] - before[0]) / max(1.0, after[1] - before[1])
                row = {"rps": len(load.latencies) / load.elapsed, "p50": percentile(load.latencies, 50) * 1000,
                       "p99": percentile(load.latencies, 99) * 1000, "hit": hit_rate * 100,
                       "failed": load.failed + load.other}
                results[arm].append(row)
                console.log(f"{arm}: {row['rps']:.2f} calls/s, p50 {row['p50']:.0f} ms, "
                            f"prefix-cache hits {row['hit']:.1f}%")
        for arm, rows in results.items():
            def cell(key: str, fmt: str, rows: list[dict[str, float]] = rows) -> str:
                values = [r[key] for r in rows]
                return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
            table.add(arm, len(rows), cell("rps", ".2f"), cell("p50", ".0f"), cell("p99", ".0f"), cell("hit", ".1f"),
                      int(sum(r["failed"] for r in rows)))
        return results
    finally:
        for server in servers:
            server.stop()


def failover(args: argparse.Namespace, table: ResultTable) -> dict[str, Any]:
    vllm_port = free_port()
    console.rule("failover: tracetrain serve --replicas 2, one SIGKILLed under load")
    gateway, db_url = start_gateway("failover", ["--replicas", "2", "--vllm-port", str(vllm_port),
                                                    "--set", "engine.vllm_listen=tcp"])  # the victim is found by port
    victim_port = vllm_port + 1
    killed_at: list[float] = []

    async def kill_later() -> None:
        await asyncio.sleep(args.seconds / 3)
        os.killpg(vllm_pid(victim_port), signal.SIGKILL)
        killed_at.append(time.monotonic())
        console.log(f"SIGKILLed the vLLM on port {victim_port}")

    try:
        load = asyncio.run(run_load(gateway.url, args, 99, during=kill_later))
        back = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            state = httpx.get(f"{gateway.url}/v1/replicas", timeout=10).json()
            if all(r["up"] for r in state["data"]):
                back = time.monotonic() - killed_at[0]
                break
            time.sleep(1)
        lost = set(load.answered) - stored_ids(db_url)
    finally:
        gateway.stop()
    table.add(len(load.answered) + load.failed + load.other, len(load.answered), load.failed, load.other, len(lost),
              "never" if back is None else f"{back:.0f}")
    return {"answered": len(load.answered), "failed": load.failed, "other": load.other, "lost": sorted(lost),
            "serving_again_after_s": back}


def routing_part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    routing = ResultTable("Routing: mean (min-max) over repeats",
                          ["arm", "runs", "calls/s", "p50 ms", "p99 ms", "prefix-cache hit %", "failed"])
    raw: dict[str, Any] = {"arguments": {k: v for k, v in vars(args).items() if k != "results_dir"},
                           "routing": routing_arms(args, routing)}
    tables = [routing]
    if not args.no_failover:
        kill = ResultTable("Failover: one of two replicas SIGKILLed under load",
                           ["calls", "answered", "failed (5xx)", "other errors", "lost", "serving again after s"],
                           right_align_from=0)
        raw["failover"] = failover(args, kill)
        tables.append(kill)
    for table in tables:
        console.print(table.rich())
    notes = [f"{args.agents} agents, sessions of {args.turns} turns; each session has its own system prompt of "
             f"{args.system_words} words, each user turn {args.tool_words} words of tool result plus a short ask; "
             f"16 sampled tokens per call, {args.seconds:.0f} s of load per arm; arms in rotated order.",
             "prefix-cache hit %: vLLM's prefix_cache_hits / prefix_cache_queries (tokens) over the arm, "
             "summed over the replicas the arm used.",
             "2 cores: one vLLM CPU server computes on one core (vLLM's own binding); two replicas on one core "
             "each, sharing both with the gateway, their API processes and the load generator.",
             "lost: calls answered 200 whose completion id is not in the store (must be 0)."]
    return Part("routing", command, provenance(started), tables, notes, raw)


PARTS = {"routing": "one replica against two, session affinity against round-robin, and failover",
         "block_size": "vLLM's KV-cache block size on the CPU and the demo's generation (`engine.block_size`)"}


def main(argv: list[str] | None = None) -> None:
    parser = parts_parser("bench.replicas", __doc__, PARTS)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--system-words", type=int, default=260, help="words in each session's system prompt")
    parser.add_argument("--tool-words", type=int, default=0,
                        help="words of tool result in each user turn (agent-like growing history)")
    parser.add_argument("--no-failover", action="store_true")
    block_size.add_arguments(parser)
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    run_parts("replicas", "vLLM serving behind the gateway (vLLM CPU, SmolLM2-135M)", PARTS,
              {"routing": routing_part, "block_size": block_size.part}, args, command_line("bench.replicas", argv))


if __name__ == "__main__":
    main()
