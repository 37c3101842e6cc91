"""CPU of the store's commit per call, and what the indexes on `sessions` add to it.

    python -m bench.commit_cost                 # about 1 minute
    python -m bench.commit_cost --calls 3000 --repeats 5

The gateway's record of one call is one write transaction: `queries.record_calls` through
`StoreWriter._commit` (SQLite in WAL mode, `synchronous=FULL`), the row of `bench.search_index_cost`
(150 words of user text, 250 prompt ids, 16 sampled). Two workloads: the
first call of a session (the session row is inserted) and a later turn (the row is touched: its
`updated_at`, `calls` and `tokens` change). Three arms, each on its own fresh store file, run
interleaved over `--repeats` rounds with identical rows: the store as created; without the six
indexes the console's session list sorts and filters by (`created_at`, `updated_at`, `model`,
`calls`, `tokens`, `reward`); without any secondary index on `sessions`. Each arm first commits
`--warmup` calls, then `--calls` timed ones; CPU is this process's (the commit runs in it, fsync's
kernel time included), wall is the time per commit.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rich.progress import Progress

from bench.common import ResultTable, console, self_cpu_seconds, write_results
from bench.search_index_cost import record_op
from tracetrain.store.db import make_engine
from tracetrain.store.writer import StoreWriter

CONSOLE_INDEXES = ["created_at", "updated_at", "model", "calls", "tokens", "reward"]
OTHER_INDEXES = ["group_id", "owner", "policy_version", "trained_version"]
ARMS = {"as created": [], "without the console list's 6": CONSOLE_INDEXES,
        "without all 10": CONSOLE_INDEXES + OTHER_INDEXES}
WORKLOADS = ["first call", "later turn"]


def _writer(directory: Path, dropped: list[str]) -> StoreWriter:
    engine = make_engine(f"sqlite:///{directory / f'{uuid.uuid4().hex}.db'}")
    with engine.begin() as conn:
        for column in dropped:
            conn.exec_driver_sql(f"DROP INDEX ix_sessions_{column}")
    return StoreWriter(engine)


def run_arm(directory: Path, dropped: list[str], workload: str, calls: int, warmup: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per commit of one call, on a fresh store."""
    writer = _writer(directory, dropped)
    for n in range(warmup):
        writer._commit([record_op(n)])
    sessions = [f"later-{i}" for i in range(max(1, calls // 8))]
    if workload == "later turn":
        for n, sid in enumerate(sessions):
            writer._commit([record_op(warmup + n, sid, new=True)])
    first = 10 * (warmup + calls)
    cpu, wall = self_cpu_seconds(), time.perf_counter()
    for n in range(first, first + calls):
        writer._commit([record_op(n) if workload == "first call" else record_op(n, sessions[n % len(sessions)])])
    cpu, wall = self_cpu_seconds() - cpu, time.perf_counter() - wall
    writer.engine.dispose()
    return 1000 * cpu / calls, 1000 * wall / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1500, help="timed commits per arm and round")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--output", default="commit_cost")
    args = parser.parse_args()
    cpu: dict[tuple[str, str], list[float]] = {}
    wall: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="tt-commit-") as tmp, Progress(console=console) as progress:
        task = progress.add_task("commits", total=args.repeats * len(WORKLOADS) * len(ARMS))
        for r in range(args.repeats):
            arms = list(ARMS.items())
            arms = arms[r % len(arms):] + arms[: r % len(arms)]  # rotate the order every round
            for workload in WORKLOADS:
                for name, dropped in arms:
                    c, w = run_arm(Path(tmp), dropped, workload, args.calls, args.warmup)
                    cpu.setdefault((workload, name), []).append(c)
                    wall.setdefault((workload, name), []).append(w)
                    progress.advance(task)
    table = ResultTable("CPU and wall time per committed call (mean over rounds, min–max)",
                        ["workload", "store", "CPU ms/commit", "CPU min–max", "wall ms/commit", "CPU vs as created"])
    for workload in WORKLOADS:
        base = statistics.mean(cpu[(workload, "as created")])
        for name in ARMS:
            values = cpu[(workload, name)]
            table.add(workload, name, f"{statistics.mean(values):.3f}", f"{min(values):.3f}–{max(values):.3f}",
                      f"{statistics.mean(wall[(workload, name)]):.3f}", f"{statistics.mean(values) - base:+.3f}")
    console.print(table.rich())
    command = f"python -m bench.commit_cost --calls {args.calls} --repeats {args.repeats}"
    notes = [f"{args.calls} timed commits per arm and round after {args.warmup} untimed ones, each arm on a fresh "
             "SQLite file (WAL, synchronous=FULL), the arms' order rotated every round",
             "a later turn touches one of calls/8 sessions (each created before the timing)"]
    path = write_results(args.output, "Store commit cost per call", command, [table], notes)
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
