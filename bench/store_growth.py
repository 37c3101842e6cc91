"""Store bytes per call against turn number for long sessions: what each call stores now (only the
request messages it added) and what it stored before (the whole request, as tracetrain 0.1 did).

    python -m bench.store_growth
    python -m bench.store_growth --turns 20 --sessions 1

Agents send their whole history with every request. A gateway (`tracetrain serve`, in-process tiny
model, 12-token replies) records `--sessions` conversations of `--turns` turns, each turn adding one
user message of about 40 characters and echoing the previous reply. Both columns come from the same
rows: "before" is the size the row would have with its whole request stored (the messages rebuilt by
`store/messages.py`, which the test suite checks are exactly what was sent), "now" the size stored.
Bytes count the call's variable columns as stored: messages and reply JSON, token id and logprob
blobs, request parameters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from typing import Any

from openai import OpenAI
from sqlmodel import Session

from bench.common import (
    OUT_DIR,
    ResultTable,
    ServerProcess,
    add_results_dir_argument,
    command_line,
    console,
    free_port,
    python_cmd,
    run_started,
    write_results,
)
from tracetrain.engines.models import tiny_model_dir
from tracetrain.store import queries
from tracetrain.store.db import open_db
from tracetrain.store.messages import full_messages
from tracetrain.store.models import Call


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.store_growth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=3)
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    started = run_started()
    out = OUT_DIR / "store_growth"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    db_url = f"sqlite:///{(out / 'store.db').resolve()}"
    port = free_port()
    server = ServerProcess("store_growth_gateway",
                           python_cmd("-m", "tracetrain.cli", "serve", "--engine", "transformers", "--model",
                                      str(tiny_model_dir()), "--served-model-name", "tiny", "--port", str(port),
                                      "--db-url", db_url), f"http://127.0.0.1:{port}")
    server.start()
    try:
        for k in range(args.sessions):
            converse(f"http://127.0.0.1:{port}", f"long-{k}", args.turns)
            console.log(f"session {k + 1}/{args.sessions}: {args.turns} turns")
    finally:
        server.stop()
    before: dict[int, list[int]] = {}
    now: dict[int, list[int]] = {}
    with Session(open_db(db_url)) as db:
        for k in range(args.sessions):
            calls = list(queries.session_calls(db, session_id=f"long-{k}"))
            by_id = {c.id: c for c in calls}
            for turn, call in enumerate(calls, start=1):
                before.setdefault(turn, []).append(row_bytes(call, full_messages(call, by_id)))
                now.setdefault(turn, []).append(row_bytes(call, call.messages))
    table = ResultTable(f"bytes per call by turn (mean over {args.sessions} sessions)",
                        ["turn", "before (whole request)", "now (what the call added)", "ratio"], right_align_from=1)
    marks = sorted({1, 2, 5, 10, 20, 30, 40, args.turns} & set(before))
    for turn in marks:
        b, n = statistics.fmean(before[turn]), statistics.fmean(now[turn])
        table.add(turn, f"{b:,.0f}", f"{n:,.0f}", f"{n / b:.2f}")
    total_before = sum(sum(v) for v in before.values()) / args.sessions
    total_now = sum(sum(v) for v in now.values()) / args.sessions
    table.add("whole session", f"{total_before:,.0f}", f"{total_now:,.0f}", f"{total_now / total_before:.2f}")
    console.print(table.rich())
    later = [statistics.fmean(now[t]) for t in range(2, args.turns + 1)]
    notes = [f"now, turns 2-{args.turns}: {min(later):,.0f}-{max(later):,.0f} bytes per call (flat: the reply "
             "echoed back, one new message, and the prompt tokens the chain does not already hold)",
             "the first call of a session and a call whose request rewrote earlier history (a new segment, no "
             "parent) store the whole request; after a gateway restart the parent's messages are read back from "
             "the store, so compaction carries on"]
    raw = {"turns": args.turns, "sessions": args.sessions,
           "bytes_by_turn": {turn: {"before": before[turn], "now": now[turn]} for turn in sorted(before)}}
    command = command_line("bench.store_growth", argv)
    path = write_results("store_growth", "Store bytes per call in long sessions", command, [table], notes,
                         raw=raw, started=started, results_dir=args.results_dir)
    console.log(f"wrote {path}")


if __name__ == "__main__":
    main()
