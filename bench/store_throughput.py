"""Committed calls per second through `StoreWriter`, the gateway's single group-commit writer.

Submitters (asyncio tasks, as the gateway's requests are) each own one session and submit, one after
another, the same write the chat route does (`queries.record_calls`): the session row added if new or
touched, and a realistic `Call` row (500 prompt ids, 100 completion ids with logprobs, a short
conversation as JSON) with its `seq` kept in memory, as the gateway keeps it. Each submit returns once
its transaction is committed, so the calls/s here bound the gateway's recorded calls/s, and the submit
latency is what every answer waits for.

Stores: SQLite in WAL mode with `synchronous=FULL` (the default: survives power loss) and `NORMAL`
(survives a killed process), both in a fresh file under the temporary directory; PostgreSQL in a
throwaway cluster (`initdb` + `pg_ctl`, as the tests do) with `fsync=on` and, for comparison, `off`.

    python -m bench.store_throughput [--seconds 4] [--concurrency 1,16,256] [--stores sqlite-full,pg]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.engine import Engine

from bench.common import (
    ResultTable,
    add_results_dir_argument,
    command_line,
    console,
    machine_line,
    percentile,
    run_started,
    write_results,
)
from tracetrain.store import queries
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Call
from tracetrain.store.writer import StoreWriter, WriteOp

STORES = {
    "sqlite-full": "SQLite WAL, synchronous=FULL",
    "sqlite-normal": "SQLite WAL, synchronous=NORMAL",
    "pg": "PostgreSQL, fsync=on",
    "pg-nofsync": "PostgreSQL, fsync=off (as in tests)",
}

_TEXT = "Let me look at the file first, then run the tests and fix what fails. " * 6


@dataclass
class RowShape:
    prompt_ids: int
    completion_ids: int


class Rows:
    """Builds calls as the chat route does; the token arrays are drawn once and reused (same sizes)."""

    def __init__(self, shape: RowShape, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.shape = shape
        self.blobs = [
            (
                encode_ids([rng.randrange(49152) for _ in range(shape.prompt_ids)]),
                encode_ids([rng.randrange(49152) for _ in range(shape.completion_ids)]),
                encode_floats([-rng.random() for _ in range(shape.completion_ids)]),
            )
            for _ in range(8)
        ]

    def call(self, session_id: str, n: int) -> Call:
        prompt, completion, logprobs = self.blobs[n % len(self.blobs)]
        messages = [
            {"role": "system", "content": _TEXT},
            {"role": "user", "content": f"turn {n}: " + _TEXT},
            {"role": "assistant", "content": _TEXT},
            {"role": "user", "content": "and now?"},
        ]
        return Call(
            id=f"chatcmpl-{session_id}-{n}-0",
            completion_id=f"chatcmpl-{session_id}-{n}",
            choice_index=0,
            session_id=session_id,
            group_id="bench",
            seq=0,
            parent_id=None,
            link="start",
            model="smollm2-135m-instruct",
            policy_version=0,
            finish_reason="stop",
            prefix_len=0,
            prompt_tokens=self.shape.prompt_ids,
            completion_tokens=self.shape.completion_ids,
            latency_ms=12.5,
            owner=None,
            state_hash=uuid.uuid4().hex * 2,
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=logprobs,
            messages=messages,
            response_message={"role": "assistant", "content": _TEXT},
            request_params={"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "stop": [], "seed": None},
        )


_CALLS = Call.__table__  # type: ignore[attr-defined]
_SESSIONS = AgentSession.__table__  # type: ignore[attr-defined]


def core_write_op(session_id: str, call: Call, seq: int) -> WriteOp:
    """The serving core's write (`tracetrain.store.queries.record_calls`, called by proxy/serving.py
    `record`), with `seq` kept in memory by the gateway: two Core statements, no ORM unit of work, no reads."""
    row = {column.name: getattr(call, column.name) for column in _CALLS.columns}
    row["seq"] = seq
    new = dict(id=session_id, group_id="bench", owner=None, policy_version=None) if seq == 0 else None
    return lambda db: queries.record_calls(db, session_id=session_id, new_session=new, rows=[row])


@dataclass
class Result:
    store: str
    concurrency: int
    committed: int
    seconds: float
    batches: int
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.committed / self.seconds

    @property
    def mean_batch(self) -> float:
        return self.committed / self.batches if self.batches else float("nan")


async def measure(
    db: Engine,
    store: str,
    concurrency: int,
    seconds: float,
    warmup: float,
    shape: RowShape,
    tag: str,
) -> Result:
    """Run `concurrency` submitters for warm-up + `seconds`; count what committed in the window."""
    writer = StoreWriter(db)
    await writer.start()
    rows = Rows(shape)
    window = {"open": False}
    latencies: list[float] = []
    stop_at = time.perf_counter() + warmup + seconds

    async def submitter(k: int) -> None:
        session_id = f"{tag}-{concurrency}-{k}"
        n = 0
        while time.perf_counter() < stop_at:
            call = rows.call(session_id, n)
            started = time.perf_counter()
            await writer.submit(core_write_op(session_id, call, n))
            if window["open"]:
                latencies.append(time.perf_counter() - started)
            n += 1

    async def open_window() -> tuple[int, int, float]:
        await asyncio.sleep(warmup)
        window["open"] = True
        return writer.committed_ops, writer.batches, time.perf_counter()

    tasks = [asyncio.create_task(submitter(k)) for k in range(concurrency)]
    ops0, batches0, t0 = await open_window()
    await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
    ops1, batches1, t1 = writer.committed_ops, writer.batches, time.perf_counter()
    await asyncio.gather(*tasks)
    await writer.stop()
    return Result(store, concurrency, ops1 - ops0, t1 - t0, batches1 - batches0, latencies)


@contextmanager
def postgres(fsync: bool) -> Iterator[Callable[[str], str]]:
    """A throwaway cluster; yields `create_database(name) -> url`."""
    from tests.support.servers import PostgresCluster

    cluster = PostgresCluster()
    if fsync:
        _start_durable(cluster)
    else:
        cluster.start()
    try:
        yield cluster.create_database
    finally:
        cluster.stop()


def _start_durable(cluster: Any) -> None:
    """`PostgresCluster.start` without its `fsync=off` (test speed-up): PostgreSQL's durable defaults."""
    as_postgres = cluster._as_postgres
    if as_postgres:
        shutil.chown(cluster.dir, "postgres", "postgres")
    data = str(cluster.dir / "data")
    initdb = [*as_postgres, "initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync"]
    subprocess.run(initdb, check=True, capture_output=True)
    pg_ctl = [
        *as_postgres,
        "pg_ctl",
        "-D",
        data,
        "-w",
        "-l",
        str(cluster.dir / "log"),
        "-o",
        f"-p {cluster.port} -k {cluster.dir}",
        "start",
    ]
    subprocess.run(pg_ctl, check=True, capture_output=True)


def run(
    stores: list[str],
    concurrencies: list[int],
    seconds: float,
    warmup: float,
    shape: RowShape,
) -> list[Result]:
    results: list[Result] = []
    tmp = Path(tempfile.mkdtemp(prefix="tt-store-bench-"))
    tag = f"s{int(time.time())}"
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("", total=len(stores) * len(concurrencies))
            for store in stores:
                with _database_factory(store, tmp) as new_database:
                    for c in concurrencies:
                        progress.update(task, description=f"{STORES[store]} · {c} submitters")
                        db = new_database(f"{store.replace('-', '_')}_{c}")
                        try:
                            results.append(asyncio.run(measure(db, store, c, seconds, warmup, shape, tag)))
                        finally:
                            db.dispose()
                        progress.advance(task)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


@contextmanager
def _database_factory(store: str, tmp: Path) -> Iterator[Callable[[str], Engine]]:
    """Yields `new(name) -> db` over a fresh database per configuration."""
    if store.startswith("sqlite"):
        synchronous = "FULL" if store == "sqlite-full" else "NORMAL"
        yield lambda name: open_db(f"sqlite:///{tmp / name}.db", sqlite_synchronous=synchronous)
        return
    with postgres(fsync=store == "pg") as create_database:
        yield lambda name: open_db(create_database(name))


def report(results: list[Result], shape: RowShape) -> ResultTable:
    table = ResultTable(
        f"StoreWriter: committed calls/s ({shape.prompt_ids} prompt ids, {shape.completion_ids} completion "
        "ids + logprobs per call)",
        ["store", "submitters", "calls/s", "mean batch", "submit p50 ms", "submit p99 ms", "calls"],
    )
    for r in results:
        table.add(
            STORES[r.store],
            r.concurrency,
            f"{r.rate:.0f}",
            f"{r.mean_batch:.1f}",
            f"{percentile(r.latencies, 50) * 1000:.2f}",
            f"{percentile(r.latencies, 99) * 1000:.2f}",
            r.committed,
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.store_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--stores", default=",".join(STORES), help=f"comma-separated of {', '.join(STORES)}")
    parser.add_argument(
        "--concurrency", default="1,16,256", help="submitters, comma-separated (default 1,16,256)"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per config (default 4)")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first (default 0.5)")
    parser.add_argument("--prompt-ids", type=int, default=500)
    parser.add_argument("--completion-ids", type=int, default=100)
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    unknown = set(stores) - set(STORES)
    if unknown:
        parser.error(f"unknown stores: {', '.join(sorted(unknown))}")
    if any(s.startswith("pg") for s in stores) and shutil.which("initdb") is None:
        console.print("[yellow]initdb not found: skipping PostgreSQL")
        stores = [s for s in stores if not s.startswith("pg")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    shape = RowShape(args.prompt_ids, args.completion_ids)
    console.rule("[bold]store throughput")
    console.print(machine_line())
    started = run_started()
    results = run(stores, concurrencies, args.seconds, args.warmup, shape)
    table = report(results, shape)
    console.print(table.rich())
    notes = [
        f"{args.seconds:g} s measured per config after {args.warmup:g} s warm-up; a fresh database each",
        "each submitter owns one session: its first write creates it, later ones touch it and take the "
        "next seq",
        "submit latency = from submit() to the commit that contains it; mean batch = ops per transaction",
        "each op is the chat route's write (`queries.record_calls`: two Core statements, seq kept in memory)",
        f"files under {tempfile.gettempdir()}; one machine with shared cores: compare rows, not machines",
    ]
    raw = {"shape": asdict(shape), "stores": STORES,
           "results": [{"store": r.store, "concurrency": r.concurrency, "committed": r.committed,
                        "seconds": r.seconds, "batches": r.batches, "calls_per_s": r.rate,
                        "submit_ms": {f"p{q}": percentile(r.latencies, q) * 1000 for q in (50, 90, 99)}}
                       for r in results]}
    path = write_results("store_throughput", "Store throughput", command_line("bench.store_throughput", argv), [table],
                         notes, raw=raw, started=started, results_dir=args.results_dir)
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
