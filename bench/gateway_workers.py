"""Throughput with 1, 2 and 4 gateway processes (`tracetrain serve --workers N`) on the fixed upstream.

The upstream (`bench.fixed_upstream`) answers in well under a millisecond, so what limits the rate is
the gateway itself: this is where more processes should help, up to the cores there are. Arms are
fresh gateways (`--workers 1`, `2`, `4`), each with its own store, in front of one upstream, run
in rotated order `--repeats` times; each arm sends the same workload (`bench.gateway_overhead`'s: a new
session per request, 150-word user messages, 16-token answers) at `--concurrency` connections after a
warm-up. Reported per arm: req/s, p50/p99, gateway CPU ms per request (all its processes), and that
every answered completion id is in the store. Stores: a SQLite file per arm (default), or with
`--store postgresql` a database per arm in one throwaway PostgreSQL cluster with its durable defaults
(`initdb` + `pg_ctl`, as bench.store_throughput starts one), on the same machine.

    python -m bench.gateway_workers                    # about 4 minutes on a 2-core CPU
    python -m bench.gateway_workers --workers 1,2 --requests 500 --repeats 2
    python -m bench.gateway_workers --store postgresql
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

from bench.common import ResultTable, console, group_cpu_seconds, machine_line, write_results
from bench.gateway_overhead import (
    APIS,
    LoadRunner,
    Plan,
    Stats,
    Target,
    Workload,
    _commit_of,
    check_store,
    start_gateway,
    start_upstream,
)
from bench.store_throughput import postgres

Arm = tuple[int, str]
"""(gateway processes, source): `tree` is the working tree, `baseline` the `--baseline-src` tree."""


def one_arm(args: argparse.Namespace, upstream_url: str, model_dir: Path, arm: Arm, tag: str,
            create_database: Callable[[str], str] | None) -> dict[str, float]:
    workers, source = arm
    tmp = Path(tempfile.mkdtemp(prefix="tt-workers-"))
    db_url = create_database(tag) if create_database else f"sqlite:///{tmp / 'gateway.db'}"
    baseline = source == "baseline"
    src = args.baseline_src if baseline else None
    gateway = start_gateway(upstream_url, model_dir, db_url, {}, src, workers=workers,
                            one_socket_per_worker=_socket_per_worker(src))
    try:
        plan = Plan(concurrencies=[args.concurrency], requests=args.requests, requests_serial=args.requests,
                    rounds=1, warmup=args.warmup, streams=[args.stream], phase_timeout_s=300,
                    request_timeout_s=120)
        workload = Workload(tag=tag, max_tokens=16, prompt_words=150, turns=1)
        runner = LoadRunner(plan, workload, {"gateway": functools.partial(group_cpu_seconds, gateway.pid)})
        target = Target("gateway", "127.0.0.1", int(gateway.url.rsplit(":", 1)[1]), via_gateway=True,
                        api=APIS["chat"])

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4", help="comma-separated gateway process counts")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=5000, help="measured requests per arm")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--upstream-workers", type=int, default=1, help="uvicorn workers of the fixed upstream")
    parser.add_argument("--output", help="results file under bench/results, without .md (default from the options)")
    parser.add_argument("--stream", action="store_true", help="streamed requests instead of one-piece answers")
    parser.add_argument("--store", choices=["sqlite", "postgresql"], default="sqlite",
                        help="each arm's store: a SQLite file, or a database in a throwaway PostgreSQL cluster")
    parser.add_argument("--baseline-src", type=Path,
                        help="also run every count from this source tree (e.g. a `git archive` of an earlier "
                             "commit), interleaved with the working tree's arms")
    args = parser.parse_args()
    sources = ["tree", "baseline"] if args.baseline_src else ["tree"]
    arms: list[Arm] = [(int(w), source) for w in args.workers.split(",") for source in sources]

    from tracetrain.engines.models import smollm2_dir

    model_dir = smollm2_dir()
    upstream_args = argparse.Namespace(upstream="fixed", upstream_url=None, max_tokens=16,
                                       upstream_workers=args.upstream_workers, token_delay_ms=0.0)
    console.print(machine_line())
    upstream = start_upstream(upstream_args, model_dir)
    results: dict[Arm, list[dict[str, float]]] = {arm: [] for arm in arms}
    with contextlib.ExitStack() as stack:
        stack.callback(upstream.stop)
        create_database = stack.enter_context(postgres(fsync=True)) if args.store == "postgresql" else None
        for repeat in range(args.repeats):
            order = arms[repeat % len(arms):] + arms[:repeat % len(arms)]
            for arm in order:
                started = time.perf_counter()
                tag = f"w{arm[0]}{arm[1]}r{repeat}t{int(time.time())}"
                row = one_arm(args, upstream.url, model_dir, arm, tag, create_database)
                results[arm].append(row)
                console.log(f"repeat {repeat}, {_label(arm)}: {row['rps']:.0f} req/s, p50 {row['p50']:.1f} ms, "
                            f"gateway CPU {row['cpu']:.2f} ms/req, missing {row['missing']} "
                            f"({time.perf_counter() - started:.0f} s)")
            console.print(f"written to {write_table(args, arms, results)}")


def write_table(args: argparse.Namespace, arms: list[Arm], results: dict[Arm, list[dict[str, float]]]) -> Path:
    """The results file from the repeats done so far (rewritten after each, so a cut-short run keeps them)."""
    table = ResultTable("Gateway processes: mean (min-max) over repeats",
                        ["workers", "runs", "req/s", "vs 1 worker", "p50 ms", "p99 ms", "gateway CPU ms/req",
                         "errors", "missing from store"])
    for arm, rows in results.items():
        if not rows:
            continue
        def cell(key: str, fmt: str, rows: list[dict[str, float]] = rows) -> str:
            values = [r[key] for r in rows]
            return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
        first = next(a for a in arms if a[1] == arm[1])  # the fewest processes from the same source
        base = statistics.mean(r["rps"] for r in results[first] or rows)
        mean_rps = statistics.mean(r["rps"] for r in rows)
        table.add(_label(arm), len(rows), cell("rps", ".0f"), f"{mean_rps / base:.2f}x", cell("p50", ".1f"),
                  cell("p99", ".1f"), cell("cpu", ".2f"), int(sum(r["errors"] for r in rows)),
                  int(sum(r["missing"] for r in rows)))
    console.print(table.rich())
    mode = "streamed" if args.stream else "one-piece (non-streamed)"
    cores = os.cpu_count() or 0
    notes = [f"{mode} requests at concurrency {args.concurrency}, {args.requests} measured per arm after "
             f"{args.warmup} warm-up; a new session per request; fixed upstream with {args.upstream_workers} "
             "worker(s)",
             f"every arm a fresh gateway and store ({_store_note(args.store)}); arms in rotated order; "
             "measured once every worker listens",
             f"{cores} cores shared by the gateway processes, the upstream and this load generator",
             f"repeats done: {min(len(rows) for rows in results.values())} of {args.repeats}"]
    if args.baseline_src:
        source = f"{args.baseline_src}{_commit_of(args.baseline_src)}"
        notes.append(f"baseline: the gateway from {source}" + (
            "" if _socket_per_worker(args.baseline_src) else " (workers on one shared socket, uvicorn's "
            "supervisor); measured once each worker process exists plus 10 s, as its workers cannot be told "
            "apart by their socket"))
    command = "python -m bench.gateway_workers " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "stream" and v is not None
    ) + (" --stream" if args.stream else "")
    name = args.output or "gateway_workers" + ("_stream" if args.stream else "") + (
        "_ab" if args.baseline_src else "") + ("_postgresql" if args.store == "postgresql" else "")
    return write_results(name, "Gateway processes on the fixed upstream", command, [table], notes)


def _store_note(store: str) -> str:
    if store == "postgresql":
        return ("a database of its own in one PostgreSQL cluster on this machine, fsync on, "
                "synchronous_commit on")
    return "a SQLite file of its own"


def _socket_per_worker(src: Path | None) -> bool:
    """Whether the gateway from `src` (None: the working tree) gives each worker its own socket."""
    return src is None or (src / "tracetrain" / "proxy" / "processes.py").exists()


def _label(arm: Arm) -> str:
    return f"{arm[0]}" + (" (baseline)" if arm[1] == "baseline" else "")


if __name__ == "__main__":
    main()
