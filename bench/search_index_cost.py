"""What SQLite's search index costs the gateway's writer per call: indexed in each call's own write (the
trigger of migration 0005) or in batches afterwards (migration 0007), against no index at all.

Each arm is a fresh store at the newest schema; the trigger arm gets 0005's insert trigger back (and its
calls are never batched), the no-index arm loses the index's tables. The write is the gateway's own
(`queries.record_calls` through `StoreWriter._commit`, one new session and one call with 150 words of
user text per request, `synchronous=FULL`), `calls per commit` calls to a transaction (1: one client at a
time; 16: a busy gateway's group commit). The batched arm's CPU includes indexing its calls
(`search_index.index_new_calls`, 256 to a transaction), as the gateway does every half second. Arms take
turns in every round; CPU is this process's (the writer runs here), per call.

    python -m bench.search_index_cost [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.common import ResultTable, console, self_cpu_seconds, write_results
from tracetrain.store import queries, search_index
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import make_engine
from tracetrain.store.models import utcnow
from tracetrain.store.writer import StoreWriter

ARMS = ["trigger (0005)", "batched (0007)", "no index"]
WORDS = ["agent", "tool", "call", "result", "search", "file", "read", "write", "plan", "step", "check",
         "answer", "question", "model", "token"]
TRIGGER = (
    "CREATE TRIGGER call_search_insert AFTER INSERT ON calls BEGIN "
    "INSERT INTO call_search_rows (call_id, session_id) VALUES (new.id, new.session_id); "
    "INSERT INTO call_search (rowid, messages, reply) "
    "VALUES (last_insert_rowid(), lower(new.messages), lower(new.response_message)); END")


def record_op(n: int, session: str | None = None, *, new: bool | None = None) -> Any:
    """The serving core's write of request `n`: a new session and its first call, or with `session` (and
    `new` False, its default then) a later call in that stored session, whose row is touched instead."""
    sid = session or f"s{n}-{uuid.uuid4().hex[:8]}"
    first = session is None if new is None else new
    text = f"Request {n}: " + " ".join(WORDS[(n * 7 + i * 13) % len(WORDS)] for i in range(150))
    row = {"id": f"c-{sid}-{n}", "completion_id": f"c-{sid}-{n}", "choice_index": 0, "session_id": sid,
           "group_id": sid, "seq": 0, "parent_id": None, "link": "start" if first else "extend", "model": "m",
           "policy_version": 0, "finish_reason": "stop",
           "prefix_len": 0, "prompt_tokens": 250, "completion_tokens": 16, "latency_ms": 1.0, "created_at": utcnow(),
           "owner": None, "state_hash": uuid.uuid4().hex * 2, "prompt_ids": encode_ids(list(range(250))),
           "completion_ids": encode_ids(list(range(16))), "completion_logprobs": encode_floats([-0.1] * 16),
           "messages": [{"role": "system", "content": "You are a careful coding agent."},
                        {"role": "user", "content": text}], "messages_inherited": 0,
           "response_message": {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."},
           "request_params": {"max_tokens": 16}}
    created = {"id": sid, "group_id": sid, "owner": None, "policy_version": 0} if first else None
    return lambda db: queries.record_calls(db, session_id=sid, new_session=created, rows=[row])


def _store(root: Path, arm: str) -> StoreWriter:
    engine = make_engine(f"sqlite:///{root / (arm.split()[0] + '.db')}")
    with engine.begin() as conn:
        if arm.startswith("trigger"):
            conn.exec_driver_sql(TRIGGER)
            conn.exec_driver_sql("DROP TABLE call_search_state")  # so that nothing batches these calls
        elif arm == "no index":
            for name in ("call_search_mark", "call_search_update", "call_search_delete"):
                conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {name}")
            for name in ("call_search_state", "call_search", "call_search_rows"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    return StoreWriter(engine)


def _phase(writer: StoreWriter, arm: str, calls: int, per_commit: int, start: int) -> float:
    """CPU seconds per call for `calls` calls, `per_commit` to a transaction (and indexed, when batched)."""
    before = self_cpu_seconds()
    for first in range(start, start + calls, per_commit):
        writer._commit([record_op(n) for n in range(first, first + per_commit)])
    if arm.startswith("batched"):
        while writer._commit([search_index.index_new_calls])[0]:
            pass
    return (self_cpu_seconds() - before) / calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.search_index_cost")
    parser.add_argument("--calls", type=int, default=2000, help="calls per arm, configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="tt-search-cost-"))
    results: dict[tuple[int, str], list[float]] = {}
    try:
        with console.status("writing…") as status:
            for per_commit in (1, 16):
                (root / str(per_commit)).mkdir()
                writers = {arm: _store(root / str(per_commit), arm) for arm in ARMS}
                for r in range(args.rounds):
                    for arm in ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]:
                        status.update(f"{per_commit} per commit, round {r + 1}: {arm}")
                        start = (r * len(ARMS) + ARMS.index(arm)) * args.calls + per_commit * 10**7
                        results.setdefault((per_commit, arm), []).append(
                            _phase(writers[arm], arm, args.calls, per_commit, start))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = ResultTable("Writer CPU per call (µs): median of the rounds (min–max)",
                        ["calls per commit", *ARMS])
    for per_commit in (1, 16):
        cells = [f"{statistics.median(v) * 1e6:.0f} ({min(v) * 1e6:.0f}–{max(v) * 1e6:.0f})"
                 for v in (results[(per_commit, arm)] for arm in ARMS)]
        table.add(per_commit, *cells)
    console.print(table.rich())
    notes = [f"{args.calls} calls per arm, configuration and round; {args.rounds} rounds, the arms' order rotated",
             "each call: a new session, 150 words of user text, a short reply; SQLite WAL, synchronous=FULL"]
    command = " ".join(["python -m bench.search_index_cost", *(argv if argv is not None else sys.argv[1:])])
    console.print(f"written to {write_results('search_index_cost', 'Search index cost', command, [table], notes)}")


if __name__ == "__main__":
    main()
