"""`python -m bench.gateway_overhead`: the flags, and one run from the servers' start to the results file, in two
parts: `overhead` (the load generator against direct and gateway targets) and `redaction` (its own module)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import (
    OUT_DIR,
    Part,
    ServerProcess,
    add_results_dir_argument,
    command_line,
    console,
    parts_parser,
    provenance,
    run_parts,
    run_started,
)
from bench.gateway_overhead import __doc__ as PACKAGE_DOC
from bench.gateway_overhead.apis import APIS
from bench.gateway_overhead.cpu import gateway_meters
from bench.gateway_overhead.load import LoadRunner, Plan, Target
from bench.gateway_overhead.redaction import redaction_part
from bench.gateway_overhead.report import gateway_name, notes, raw, report
from bench.gateway_overhead.servers import (
    UPSTREAMS,
    Upstream,
    port_of,
    start_gateway,
    start_upstream,
    upstream_pgid,
)
from bench.gateway_overhead.store_check import check_stores
from bench.gateway_overhead.workload import MODEL_NAME, Workload

NAME = "gateway_overhead"
PARTS = {"overhead": "what the gateway adds on top of the upstream",
         "redaction": "redaction's CPU per call and the detectors (formerly `bench.gateway_overhead.redaction`)"}


def parser() -> argparse.ArgumentParser:
    p = parts_parser("bench.gateway_overhead", PACKAGE_DOC, PARTS)
    p.add_argument("--upstream", choices=UPSTREAMS, default="fixed",
                   help="the fixed-output server (default) or real vLLM on SmolLM2")
    p.add_argument("--upstream-url", help="use the server already running here instead of starting one (with "
                   f"--upstream vllm: a vLLM serving the SmolLM2 directory as '{MODEL_NAME}')")
    p.add_argument("--gateway-workers", default="1",
                   help="comma-separated process counts (`serve --workers N`): one gateway per count, each on its "
                   "own store, interleaved as targets (default 1)")
    p.add_argument("--concurrency", help="comma-separated client connections (default 1,16,64; vllm: 1,16)")
    p.add_argument("--requests", type=int, help="per target and config at concurrency > 1 (default 1000; vllm: 48)")
    p.add_argument("--requests-serial", type=int, help="per target at concurrency 1 (default 200; vllm: 12)")
    p.add_argument("--rounds", type=int, default=2, help="alternating direct/gateway rounds per config (default 2)")
    p.add_argument("--warmup", type=int, help="warm-up requests per target and mode (default 100; vllm: 4)")
    p.add_argument("--mode", choices=["both", "non-stream", "stream"], default="both")
    p.add_argument("--apis", default="chat,responses,messages",
                   help="gateway APIs to measure, each against the same direct chat baseline (default: all three)")
    p.add_argument("--sessions", choices=["unique", "multiturn"], default="unique",
                   help="a new session per request (default), or growing conversations")
    p.add_argument("--turns", type=int, default=6, help="requests per session with --sessions multiturn")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (fixed: the answer length)")
    p.add_argument("--prompt-words", type=int, default=150, help="words in each user message (default 150)")
    p.add_argument("--db-url", help="gateway store (default: a fresh SQLite file in a temporary directory)")
    p.add_argument("--gateway-src", type=Path, help="run the gateway from this source tree (a directory holding "
                   "`tracetrain/`, e.g. a `git archive` snapshot) instead of the working tree")
    p.add_argument("--baseline-src", type=Path, help="also start a second gateway from this source tree on its own "
                   "store, and interleave its targets with the working tree's: an A/B in one run")
    p.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the gateway, e.g. TRACETRAIN_STORE__SQLITE_SYNCHRONOUS=NORMAL (repeatable)")
    p.add_argument("--phase-timeout", type=float, default=180.0, help="stop sending in a phase after this (s)")
    p.add_argument("--redaction-rounds", type=int, default=30,
                   help="part redaction: sessions timed per conversation length and mode (default 30)")
    add_results_dir_argument(p)
    return p


def plan_of(args: argparse.Namespace) -> Plan:
    """The counts: vLLM computes every answer, so its defaults are small."""
    vllm = args.upstream == "vllm"
    return Plan(
        concurrencies=[int(c) for c in (args.concurrency or ("1,16" if vllm else "1,16,64")).split(",")],
        requests=args.requests or (48 if vllm else 1000),
        requests_serial=args.requests_serial or (12 if vllm else 200),
        rounds=max(1, args.rounds),
        warmup=args.warmup if args.warmup is not None else (4 if vllm else 100),
        streams={"both": [False, True], "non-stream": [False], "stream": [True]}[args.mode],
        phase_timeout_s=args.phase_timeout,
        request_timeout_s=300.0 if vllm else 60.0,
    )


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_parts(NAME, "Gateway overhead", PARTS, {"overhead": overhead_part, "redaction": redaction_part}, args,
              command_line("bench.gateway_overhead", argv))


def overhead_part(args: argparse.Namespace, command: str) -> Part:
    vllm = args.upstream == "vllm"
    plan = plan_of(args)
    workload = Workload(tag=f"bench{int(time.time())}", max_tokens=args.max_tokens, prompt_words=args.prompt_words,
                        turns=args.turns if args.sessions == "multiturn" else 1, temperature=0.0 if vllm else None,
                        long_answer_prompt=vllm)
    gateway_env = dict(item.split("=", 1) for item in args.gateway_env)
    worker_counts = [int(w) for w in args.gateway_workers.split(",")]
    if args.db_url and len(worker_counts) > 1:
        raise SystemExit("--db-url names one store; several --gateway-workers counts each need their own")
    apis = args.apis.split(",")
    if unknown := set(apis) - set(APIS):
        raise SystemExit(f"--apis: unknown {sorted(unknown)}; choose from {sorted(APIS)}")

    from tracetrain.engines.models import smollm2_dir

    model_dir = smollm2_dir()
    tmp = Path(tempfile.mkdtemp(prefix="tt-bench-"))
    db_url = args.db_url or f"sqlite:///{tmp / 'gateway.db'}"
    console.rule(f"[bold]part overhead · {args.upstream} upstream · {args.sessions} sessions")
    started = run_started()
    upstream: Upstream | None = None
    gateways: dict[str, ServerProcess] = {}
    """By meter: `gateway` (the first count of --gateway-workers), `gateway ×N` for the others, `baseline`."""
    db_urls: dict[str, str] = {}
    try:
        with console.status("starting the upstream…"):
            upstream = start_upstream(args.upstream, model_dir, url=args.upstream_url, max_tokens=args.max_tokens)
        vias: list[Target] = []
        with console.status("starting the gateway…"):
            for i, workers in enumerate(worker_counts):
                meter = "gateway" if i == 0 else f"gateway ×{workers}"
                db_urls[meter] = db_url if i == 0 else f"sqlite:///{tmp / f'gateway-{workers}.db'}"
                gateways[meter] = start_gateway(upstream.url, model_dir, db_urls[meter], gateway_env,
                                                args.gateway_src, workers=workers)
                suffix = f" ×{workers}" if len(worker_counts) > 1 else ""
                vias += [Target(gateway_name(api) + suffix, "127.0.0.1", port_of(gateways[meter]), via_gateway=True,
                                api=APIS[api], meter=meter) for api in apis]
            if args.baseline_src:
                db_urls["baseline"] = f"sqlite:///{tmp / 'baseline.db'}" if db_url.startswith("sqlite") else db_url
                gateways["baseline"] = start_gateway(upstream.url, model_dir, db_urls["baseline"], gateway_env,
                                                     args.baseline_src)
                vias += [Target(f"gateway {api} (baseline)", "127.0.0.1", port_of(gateways["baseline"]),
                                via_gateway=True, api=APIS[api], meter="baseline") for api in apis]
        console.print(f"upstream {upstream.url} · gateways {[g.url for g in gateways.values()]} · store {db_url} · "
                      f"logs in {OUT_DIR}")
        meters = gateway_meters({meter: server.pid for meter, server in gateways.items()}, upstream_pgid(upstream))
        runner = LoadRunner(plan, workload, meters)
        host, upstream_port = upstream.url.removeprefix("http://").rsplit(":", 1)
        direct = Target("direct", host, int(upstream_port), via_gateway=False, api=APIS["chat"])
        phases_started = time.perf_counter()
        results = asyncio.run(runner.run([direct, *vias]))
        elapsed = time.perf_counter() - phases_started
        with console.status("checking the store…"):
            check = check_stores(db_urls, runner.received, None if vllm else args.max_tokens)
    finally:
        for server in gateways.values():
            server.stop()
        if upstream is not None:
            upstream.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    tables = report(results, plan, check, args.upstream, vias)
    for table in tables:
        console.print(table.rich())
    return Part("overhead", command, provenance(started), tables,
                notes(args, plan, len(vias), elapsed, worker_counts, gateway_env), raw(results, check, args))
