"""Committed calls per second through `StoreWriter`, the gateway's single group-commit writer.

Submitters (asyncio tasks, as the gateway's requests are) each own one session and submit, one after
another, the same write the chat route does: look the session up, add it if new or touch it, take the
next `seq`, add a realistic `Call` row (500 prompt ids, 100 completion ids with logprobs, a short
conversation as JSON), flush. Each submit returns once its transaction is committed, so the calls/s
here bound the gateway's recorded calls/s, and the submit latency is what every answer waits for.

Stores: SQLite in WAL mode with `synchronous=FULL` (the default: survives power loss) and `NORMAL`
(survives a killed process), both in a fresh file under the temporary directory; PostgreSQL in a
throwaway cluster (`initdb` + `pg_ctl`, as the tests do) with `fsync=on` and, for comparison, `off`.

    python -m bench.store_throughput [--seconds 4] [--concurrency 1,16,256] [--stores sqlite-full,pg]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bench.common import ResultTable, console, machine_line, percentile, write_results
from tracetrain.store import queries
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import make_engine
from tracetrain.store.models import AgentSession, Call, utcnow
from tracetrain.store.writer import StoreWriter

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


def write_op(session_id: str, call: Call) -> Callable[[Session], None]:
    """The chat route's earlier ORM write, kept for comparison: the session row (new or touched), the
    next seq by query, the call, through the ORM unit of work."""

    def write(db: Session) -> None:
        session = db.get(AgentSession, session_id)
        if session is None:
            db.add(AgentSession(id=session_id, group_id="bench", owner=None))
        else:
            session.updated_at = utcnow()
            db.add(session)
        call.seq = queries.next_seq(db, session_id=session_id) if session is not None else 0
        db.add(call)
        db.flush()

    return write


_CALLS = Call.__table__  # type: ignore[attr-defined]
_SESSIONS = AgentSession.__table__  # type: ignore[attr-defined]


def core_write_op(session_id: str, call: Call, seq: int) -> Callable[[Session], None]:
    """The serving core's write (`tracetrain.store.queries.record_calls`, called by proxy/serving.py
    `record`), with `seq` kept in memory by the gateway: two Core statements, no ORM unit of work, no reads."""
    row = {column.name: getattr(call, column.name) for column in _CALLS.columns}
    row["seq"] = seq
    new = dict(id=session_id, group_id="bench", owner=None, policy_version=None) if seq == 0 else None
    return lambda db: queries.record_calls(db, session_id=session_id, new_session=new, rows=[row])


WRITES = {"orm": "earlier ORM write", "core": "chat route's Core write"}


@dataclass
class Result:
    store: str
    write: str
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
    engine: Engine,
    store: str,
    write: str,
    concurrency: int,
    seconds: float,
    warmup: float,
    shape: RowShape,
    tag: str,
) -> Result:
    """Run `concurrency` submitters for warm-up + `seconds`; count what committed in the window."""
    writer = StoreWriter(engine)
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
            op = write_op(session_id, call) if write == "orm" else core_write_op(session_id, call, n)
            await writer.submit(op)
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
    return Result(store, write, concurrency, ops1 - ops0, t1 - t0, batches1 - batches0, latencies)


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
    writes: list[str],
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
            task = progress.add_task("", total=len(stores) * len(writes) * len(concurrencies))
            for store in stores:
                with _database_factory(store, tmp) as new_database:
                    for write in writes:
                        for c in concurrencies:
                            progress.update(task, description=f"{STORES[store]} · {write} · {c} submitters")
                            engine = new_database(f"{store.replace('-', '_')}_{write}_{c}")
                            try:
                                measured = measure(engine, store, write, c, seconds, warmup, shape, tag)
                                results.append(asyncio.run(measured))
                            finally:
                                engine.dispose()
                            progress.advance(task)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


@contextmanager
def _database_factory(store: str, tmp: Path) -> Iterator[Callable[[str], Engine]]:
    """Yields `new(name) -> engine` over a fresh database per configuration."""
    if store.startswith("sqlite"):
        synchronous = "FULL" if store == "sqlite-full" else "NORMAL"
        yield lambda name: make_engine(f"sqlite:///{tmp / name}.db", sqlite_synchronous=synchronous)
        return
    with postgres(fsync=store == "pg") as create_database:
        yield lambda name: make_engine(create_database(name))


def report(results: list[Result], shape: RowShape) -> ResultTable:
    table = ResultTable(
        f"StoreWriter: committed calls/s ({shape.prompt_ids} prompt ids, {shape.completion_ids} completion "
        "ids + logprobs per call)",
        ["store", "write", "submitters", "calls/s", "mean batch", "submit p50 ms", "submit p99 ms", "calls"],
    )
    for r in results:
        table.add(
            STORES[r.store],
            r.write,
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
        "--writes", default="orm,core", help="core (the chat route's write), orm (the earlier ORM write), or both"
    )
    parser.add_argument(
        "--concurrency", default="1,16,256", help="submitters, comma-separated (default 1,16,256)"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per config (default 4)")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first (default 0.5)")
    parser.add_argument("--prompt-ids", type=int, default=500)
    parser.add_argument("--completion-ids", type=int, default=100)
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
    writes = [w for w in args.writes.split(",") if w]
    if set(writes) - set(WRITES):
        parser.error(f"--writes takes {', '.join(WRITES)}")
    results = run(stores, writes, concurrencies, args.seconds, args.warmup, shape)
    table = report(results, shape)
    console.print(table.rich())
    notes = [
        f"{args.seconds:g} s measured per config after {args.warmup:g} s warm-up; a fresh database each",
        "each submitter owns one session: its first write creates it, later ones touch it and take the "
        "next seq",
        "submit latency = from submit() to the commit that contains it; mean batch = ops per transaction",
        "write core = the chat route's write (two Core statements per op, seq kept in memory); "
        "orm = the earlier ORM write (session get, next_seq query, ORM add + flush per op), for comparison",
        f"files under {tempfile.gettempdir()}; one machine with shared cores: compare rows, not machines",
    ]
    command = " ".join(["python -m bench.store_throughput", *map(shlex.quote, argv or sys.argv[1:])])
    path = write_results("store_throughput", "Store throughput", command, [table], notes)
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
