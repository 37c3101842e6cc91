"""The store, in two parts: `writer`, committed calls per second through `StoreWriter`, the gateway's single
group-commit writer; `growth`, store bytes per call against turn number in long sessions.

    python -m bench.store_throughput                         # both parts
    python -m bench.store_throughput --parts writer [--seconds 4] [--concurrency 1,16,256] [--stores sqlite-full,pg]
    python -m bench.store_throughput --parts growth [--turns 50] [--sessions 3]

`writer`: submitters (asyncio tasks, as the gateway's requests are) each own one session and submit, one
after another, the same write the chat route does (`queries.record_calls`): the session row added if new or
touched, and a realistic `Call` row (500 prompt ids, 100 completion ids with logprobs, a short
conversation as JSON) with its `seq` kept in memory, as the gateway keeps it. Each submit returns once
its transaction is committed, so the calls/s here bound the gateway's recorded calls/s, and the submit
latency is what every answer waits for. Stores: SQLite in WAL mode with `synchronous=FULL` (the default:
survives power loss) and `NORMAL` (survives a killed process), both in a fresh file under the temporary
directory; PostgreSQL in a throwaway cluster (`initdb` + `pg_ctl`, as the tests do) with `fsync=on` and,
for comparison, `off`.

`growth`: what each call stores now (only the request messages it added) against what it stored before (the
whole request, as tracetrain 0.1 did). Agents send their whole history with every request. A gateway
(`tracetrain serve`, in-process tiny model, 12-token replies) records `--sessions` conversations of
`--turns` turns, each turn adding one user message of about 40 characters and echoing the previous reply.
Both columns come from the same rows: "before" is the size the row would have with its whole request
stored (the messages rebuilt by `store/messages.py`, which the test suite checks are exactly what was
sent), "now" the size stored. Bytes count the call's variable columns as stored: messages and reply JSON,
token id and logprob blobs, request parameters. (Formerly `bench.store_growth`.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openai import OpenAI
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.engine import Engine
from sqlmodel import Session

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
from tracetrain.store import queries
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import open_db
from tracetrain.store.messages import full_messages
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


# ---------------------------------------------------------------- part `growth`


def row_bytes(call: Call, messages: list[dict[str, Any]]) -> int:
    return (len(json.dumps(messages)) + len(json.dumps(call.response_message)) + len(call.prompt_ids)
            + len(call.completion_ids) + len(call.completion_logprobs) + len(json.dumps(call.request_params)))


def converse(base_url: str, session: str, turns: int) -> None:
    client = OpenAI(base_url=f"{base_url}/s/{session}/v1", api_key="unused")
    history: list[Any] = [{"role": "system", "content": "You are a patient assistant who answers in one line."}]
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn}: one more idea on topic {turn * 7 % 13}?"})
        reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=12, seed=turn)
        history.append(reply.choices[0].message.model_dump(exclude_none=True))


def growth(turns: int, sessions: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(before, now): each call's bytes by turn, with its whole request stored and as stored."""
    from tracetrain.engines.models import tiny_model_dir

    out = OUT_DIR / "store_growth"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    db_url = f"sqlite:///{(out / 'store.db').resolve()}"
    port = free_port()
    server = ServerProcess("store_growth_gateway",
                           python_cmd("-m", "tracetrain.cli", "serve", "--engine", "transformers", "--model",
                                      str(tiny_model_dir()), "--served-model-name", "tiny", "--port", str(port),
                                      "--db-url", db_url), f"http://127.0.0.1:{port}")
    with console.status("starting the gateway on the tiny model…"):
        server.start()
    try:
        for k in range(sessions):
            t0 = time.perf_counter()
            converse(f"http://127.0.0.1:{port}", f"long-{k}", turns)
            console.log(f"session {k + 1}/{sessions}: {turns} turns, {turns / (time.perf_counter() - t0):.1f} "
                        "calls/s")
    finally:
        server.stop()
    before: dict[int, list[int]] = {}
    now: dict[int, list[int]] = {}
    with Session(open_db(db_url)) as db:
        for k in range(sessions):
            calls = list(queries.session_calls(db, session_id=f"long-{k}"))
            by_id = {c.id: c for c in calls}
            for turn, call in enumerate(calls, start=1):
                before.setdefault(turn, []).append(row_bytes(call, full_messages(call, by_id)))
                now.setdefault(turn, []).append(row_bytes(call, call.messages))
    return before, now


def growth_part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    before, now = growth(args.turns, args.sessions)
    table = ResultTable(f"bytes per call by turn (mean over {args.sessions} sessions)",
                        ["turn", "before (whole request)", "now (what the call added)", "ratio"])
    for turn in sorted({1, 2, 5, 10, 20, 30, 40, args.turns} & set(before)):
        b, n = statistics.fmean(before[turn]), statistics.fmean(now[turn])
        table.add(turn, f"{b:,.0f}", f"{n:,.0f}", f"{n / b:.2f}")
    total_before = sum(sum(v) for v in before.values()) / args.sessions
    total_now = sum(sum(v) for v in now.values()) / args.sessions
    table.add("whole session", f"{total_before:,.0f}", f"{total_now:,.0f}", f"{total_now / total_before:.2f}")
    console.print(table.rich())
    later = [statistics.fmean(now[t]) for t in range(2, args.turns + 1) if t in now]
    notes = [f"now, turns 2-{args.turns}: {min(later):,.0f}-{max(later):,.0f} bytes per call (flat: the reply "
             "echoed back, one new message, and the prompt tokens the chain does not already hold)" if later else
             "one turn only: nothing to compare",
             "the first call of a session and a call whose request rewrote earlier history (a new segment, no "
             "parent) store the whole request; after a gateway restart the parent's messages are read back from "
             "the store, so compaction carries on"]
    raw = {"turns": args.turns, "sessions": args.sessions,
           "bytes_by_turn": {turn: {"before": before[turn], "now": now[turn]} for turn in sorted(before)}}
    return Part("growth", command, provenance(started), [table], notes, raw)


# ---------------------------------------------------------------- part `writer`


def writer_part(args: argparse.Namespace, command: str) -> Part:
    stores = [s for s in args.stores.split(",") if s]
    if any(s.startswith("pg") for s in stores) and shutil.which("initdb") is None:
        console.print("[yellow]initdb not found: skipping PostgreSQL")
        stores = [s for s in stores if not s.startswith("pg")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    shape = RowShape(args.prompt_ids, args.completion_ids)
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
        "files under the temporary directory; one machine with shared cores: compare rows, not machines",
    ]
    raw = {"shape": asdict(shape), "stores": STORES,
           "results": [{"store": r.store, "concurrency": r.concurrency, "committed": r.committed,
                        "seconds": r.seconds, "batches": r.batches, "calls_per_s": r.rate,
                        "submit_ms": {f"p{q}": percentile(r.latencies, q) * 1000 for q in (50, 90, 99)}}
                       for r in results]}
    return Part("writer", command, provenance(started), [table], notes, raw)


PARTS = {"writer": "committed calls/s through the store's writer",
         "growth": "store bytes per call in long sessions (formerly `bench.store_growth`)"}


def main(argv: list[str] | None = None) -> None:
    parser = parts_parser("bench.store_throughput", __doc__, PARTS)
    writer = parser.add_argument_group("part writer")
    writer.add_argument("--stores", default=",".join(STORES), help=f"comma-separated of {', '.join(STORES)}")
    writer.add_argument("--concurrency", default="1,16,256", help="submitters, comma-separated (default 1,16,256)")
    writer.add_argument("--seconds", type=float, default=4.0, help="measured seconds per config (default 4)")
    writer.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first (default 0.5)")
    writer.add_argument("--prompt-ids", type=int, default=500)
    writer.add_argument("--completion-ids", type=int, default=100)
    grow = parser.add_argument_group("part growth")
    grow.add_argument("--turns", type=int, default=50, help="turns per session (default 50)")
    grow.add_argument("--sessions", type=int, default=3, help="sessions (default 3)")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    if unknown := set(s for s in args.stores.split(",") if s) - set(STORES):
        parser.error(f"unknown stores: {', '.join(sorted(unknown))}")
    run_parts("store_throughput", "Store throughput and growth", PARTS,
              {"writer": writer_part, "growth": growth_part}, args, command_line("bench.store_throughput", argv))

if __name__ == "__main__":
    main()
