"""Throughput with 1, 2 and 4 gateway processes (`tracetrain serve --workers N`) on the fixed upstream.

The upstream (`bench.gateway_overhead.fixed_upstream`) does next to nothing per request, so what
limits the rate is the gateway itself: this is where more processes should help, up to the cores there
are. Arms are fresh gateways (`--workers 1`, `2`, `4`) per store, each with a store of its own, in front
of one upstream, run in rotated order `--repeats` times; each arm sends `bench.gateway_overhead`'s
workload (a new session per request, 150-word user messages, 16-token answers) at `--concurrency`
connections after a warm-up, and is measured once every worker listens. Reported per arm: req/s,
p50/p99, gateway CPU ms per request (all its processes), and that every answered completion id is in the
store. Stores: a SQLite file per arm, and a database per arm in one throwaway PostgreSQL cluster with its
durable defaults (`initdb` + `pg_ctl`, as bench.store_throughput starts one; skipped without them).

    python -m bench.gateway_workers                    # SQLite and PostgreSQL
    python -m bench.gateway_workers --workers 1,2 --requests 500 --repeats 2 --stores sqlite
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    ResultTable,
    RunStart,
    add_results_dir_argument,
    command_line,
    console,
    machine_line,
    run_started,
    write_results,
)
from bench.gateway_overhead.apis import APIS
from bench.gateway_overhead.cpu import group_cpu_seconds
from bench.gateway_overhead.load import LoadRunner, Plan, Stats, Target
from bench.gateway_overhead.servers import commit_of, port_of, start_gateway, start_upstream
from bench.gateway_overhead.store_check import check_store
from bench.gateway_overhead.workload import Workload
from bench.store_throughput import postgres

STORES = {"sqlite": "a SQLite file of its own",
          "postgresql": "a database of its own in one PostgreSQL cluster on this machine, fsync on, "
                        "synchronous_commit on"}
Arm = tuple[str, int, str]
"""(store, gateway processes, source): `tree` is the working tree, `baseline` the `--baseline-src` tree."""


def one_arm(args: argparse.Namespace, upstream_url: str, model_dir: Path, arm: Arm, tag: str,
            create_database: Callable[[str], str] | None) -> dict[str, float]:
    store, workers, source = arm
    tmp = Path(tempfile.mkdtemp(prefix="tt-workers-"))
    db_url = create_database(tag) if create_database else f"sqlite:///{tmp / 'gateway.db'}"
    src = args.baseline_src if source == "baseline" else None
    gateway = start_gateway(upstream_url, model_dir, db_url, {}, src, workers=workers)
    try:
        plan = Plan(concurrencies=[args.concurrency], requests=args.requests, requests_serial=args.requests,
                    rounds=1, warmup=args.warmup, streams=[args.stream], phase_timeout_s=300,
                    request_timeout_s=120)
        workload = Workload(tag=tag, max_tokens=16, prompt_words=150, turns=1)
        runner = LoadRunner(plan, workload, {"gateway": functools.partial(group_cpu_seconds, gateway.pid)})
        target = Target("gateway", "127.0.0.1", port_of(gateway), via_gateway=True, api=APIS["chat"])

        async def run() -> Stats:
            # Warm-up with every connection, so that each worker process has served (and compiled its
            # templates) before the measured phase.
            await runner.phase(target, stream=args.stream, concurrency=args.concurrency, requests=args.warmup,
                               stats=Stats())
            stats = Stats()
            await runner.phase(target, stream=args.stream, concurrency=args.concurrency, requests=args.requests,
                               stats=stats)
            return stats

        stats = asyncio.run(run())
        check = check_store(db_url, runner.received.get("gateway", set()), 16)
    finally:
        gateway.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rps": stats.rps, "p50": stats.latency_ms(50), "p99": stats.latency_ms(99),
            "cpu": stats.cpu_ms_per_request("gateway"), "errors": sum(stats.errors.values()),
            "missing": check.missing}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_workers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4", help="comma-separated gateway process counts")
    parser.add_argument("--stores", default="sqlite,postgresql",
                        help="comma-separated of sqlite, postgresql (PostgreSQL is skipped without initdb)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=5000, help="measured requests per arm")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--upstream-workers", type=int, default=1,
                        help="uvicorn workers of the fixed upstream (on many cores one of them caps the run)")
    parser.add_argument("--stream", action="store_true", help="streamed requests instead of one-piece answers")
    parser.add_argument("--baseline-src", type=Path,
                        help="also run every count from this source tree (e.g. a `git archive` of an earlier "
                             "commit), interleaved with the working tree's arms")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    if unknown := set(stores) - set(STORES):
        parser.error(f"--stores: unknown {sorted(unknown)}")
    skipped = "postgresql" in stores and shutil.which("initdb") is None
    if skipped:
        console.print("[yellow]initdb not found: skipping PostgreSQL")
        stores.remove("postgresql")
    sources = ["tree", "baseline"] if args.baseline_src else ["tree"]
    arms = {store: [(store, int(w), source) for w in args.workers.split(",") for source in sources]
            for store in stores}

    from tracetrain.engines.models import smollm2_dir

    model_dir = smollm2_dir()
    console.print(machine_line())
    started = run_started()
    results: dict[Arm, list[dict[str, float]]] = {arm: [] for store in stores for arm in arms[store]}
    path: Path | None = None
    with contextlib.ExitStack() as stack:
        upstream = start_upstream("fixed", model_dir, max_tokens=16, workers=args.upstream_workers)
        stack.callback(upstream.stop)
        for store in stores:
            create_database = stack.enter_context(postgres(fsync=True)) if store == "postgresql" else None
            for repeat in range(args.repeats):
                order = arms[store][repeat % len(arms[store]):] + arms[store][:repeat % len(arms[store])]
                for arm in order:
                    began = time.perf_counter()
                    tag = f"w{arm[1]}{arm[2]}r{repeat}t{int(time.time())}"
                    row = one_arm(args, upstream.url, model_dir, arm, tag, create_database)
                    results[arm].append(row)
                    console.log(f"{store} repeat {repeat}, {_label(arm)}: {row['rps']:.0f} req/s, p50 "
                                f"{row['p50']:.1f} ms, gateway CPU {row['cpu']:.2f} ms/req, missing "
                                f"{row['missing']} ({time.perf_counter() - began:.0f} s)")
                # rewritten after every repeat, so that a run cut short keeps what it measured
                path = write_table(args, argv, results, started, skipped)
    console.print(f"written to {path}")


def write_table(args: argparse.Namespace, argv: list[str] | None, results: dict[Arm, list[dict[str, float]]],
                started: RunStart, skipped_postgresql: bool) -> Path:
    table = ResultTable("Gateway processes: mean (min-max) over repeats",
                        ["store", "workers", "runs", "req/s", "vs 1 worker", "p50 ms", "p99 ms",
                         "gateway CPU ms/req", "errors", "missing from store"])
    for arm, rows in results.items():
        if not rows:
            continue
        def cell(key: str, fmt: str, rows: list[dict[str, float]] = rows) -> str:
            values = [r[key] for r in rows]
            return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
        # against the fewest processes of the same store and source
        first = next(a for a in results if a[0] == arm[0] and a[2] == arm[2])
        base = statistics.mean(r["rps"] for r in results[first] or rows)
        mean_rps = statistics.mean(r["rps"] for r in rows)
        table.add(arm[0], _label(arm), len(rows), cell("rps", ".0f"), f"{mean_rps / base:.2f}x", cell("p50", ".1f"),
                  cell("p99", ".1f"), cell("cpu", ".2f"), int(sum(r["errors"] for r in rows)),
                  int(sum(r["missing"] for r in rows)))
    console.print(table.rich())
    mode = "streamed" if args.stream else "one-piece (non-streamed)"
    done = min(len(rows) for rows in results.values())
    notes = [f"{mode} requests at concurrency {args.concurrency}, {args.requests} measured per arm after "
             f"{args.warmup} warm-up; a new session per request; fixed upstream with {args.upstream_workers} "
             "worker(s)",
             "every arm a fresh gateway and store (" + "; ".join(f"{s}: {STORES[s]}" for s in
                                                              dict.fromkeys(a[0] for a in results)) + "); "
             "arms of a store in rotated order; measured once every worker listens",
             f"{os.cpu_count()} cores shared by the gateway processes, the upstream and this load generator",
             f"repeats done: {done} of {args.repeats} for every arm"]
    if skipped_postgresql:
        notes.append("PostgreSQL skipped: no initdb on PATH")
    if args.baseline_src:
        notes.append(f"baseline: the gateway from {args.baseline_src}{commit_of(args.baseline_src)}")
    raw: dict[str, Any] = {"arguments": {k: str(v) for k, v in vars(args).items()},
                           "arms": [{"store": a[0], "workers": a[1], "source": a[2], "runs": rows}
                                    for a, rows in results.items()]}
    return write_results("gateway_workers", "Gateway processes on the fixed upstream",
                         command_line("bench.gateway_workers", argv), [table], notes, raw=raw, started=started,
                         results_dir=args.results_dir)


def _label(arm: Arm) -> str:
    return f"{arm[1]}" + (" (baseline)" if arm[2] == "baseline" else "")


if __name__ == "__main__":
    main()
