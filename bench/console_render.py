"""The console on a big store: time to first render of the sessions page and of a long session.

A store is filled with `--sessions` sessions (1 to 5 calls each, a chained conversation of short
turns, SmolLM2's real token ids) plus one 50-call session of about 20k tokens, written straight into the
tables as the gateway writes them (the gateway's own record path would take hours for 100k sessions on
this machine). A real `tracetrain serve` (in-process engine; it generates nothing here) then serves
the console, and for each page we measure:

- server time: the wall time of each JSON request the page makes (loopback HTTP included), summed over
  the page's requests: the sessions page asks `/v1/whoami` and `/v1/sessions?limit=50`; a session page
  asks `/v1/sessions/{id}`, `/v1/sessions/{id}/trajectory?text=true` and `/v1/sessions/{id}/actions`;
- first render: Debian's chromium (Playwright) from navigation until the page's table or token view is
  in the DOM, when chromium and playwright are installed.

Stores: SQLite (a file in a temporary directory) and PostgreSQL (a throwaway cluster, `initdb` +
`pg_ctl` as the tests start one, skipped where they are not installed); or one store of yours by URL.
The text search is timed for a common word (in most sessions) and a rare one (about 0.3 % of them),
the case the search index is for.

Target, fixed before the run: server time under 500 ms for each page (the issue's figure).

    python -m bench.console_render --sessions 100000 [--stores sqlite,postgresql | --db-url URL]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from bench.common import ResultTable, ServerProcess, console, free_port, machine_line, python_cmd, write_results
from bench.store_throughput import postgres
from tracetrain.store.codec import encode_floats, encode_ids

ADMIN = "bench-admin"
LONG_SESSION = "long-50-calls"
MODELS = ["smollm2-135m-instruct", "agent-model-b"]
COMMON, RARE = "retry", "zebra"
"""Searched words: COMMON is one of the 10 words each message draws 12 from (in about 3 of 4
messages); RARE replaces one word in 1 message of 1,000."""
STORES = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}


def _call(session: str, seq: int, parent: str | None, prefix: int, prompt: list[int], sampled: list[int],
          when: datetime, model: str, text: str) -> dict[str, Any]:
    call_id = f"{session}-c{seq}"
    return {"id": f"{call_id}-0", "completion_id": call_id, "choice_index": 0, "session_id": session,
            "group_id": session[:6], "seq": seq, "parent_id": parent, "link": "start" if parent is None else "extend",
            "model": model, "policy_version": seq % 3, "finish_reason": "stop", "prefix_len": prefix,
            "prompt_tokens": prefix + len(prompt), "completion_tokens": len(sampled), "latency_ms": 40.0,
            "created_at": when, "owner": None, "state_hash": hashlib.sha256(f"{call_id}".encode()).hexdigest(),
            "prompt_ids": encode_ids(prompt), "completion_ids": encode_ids(sampled),
            "completion_logprobs": encode_floats([-0.5] * len(sampled)),
            "messages": [{"role": "user", "content": text}], "messages_inherited": 2 * seq,
            "response_message": {"role": "assistant", "content": f"reply {seq}"}, "request_params": {}}


def fill(db_url: str, sessions: int, seed: int) -> None:
    """`sessions` short sessions and one long one, in batches of 2,000 sessions per transaction."""
    from sqlalchemy import insert

    from tracetrain.store.db import make_engine
    from tracetrain.store.models import AgentSession, Call, Reward

    rng = random.Random(seed)
    engine = make_engine(db_url)
    words = ["plan", "search", "read", "answer", "check", "tool", "result", "file", "error", "retry"]
    start = datetime.now(UTC) - timedelta(days=7)
    with Progress(console=console) as progress, engine.begin() as conn:
        task = progress.add_task("filling the store", total=sessions + 1)
        for first in range(0, sessions + 1, 2000):
            rows_s, rows_c, rows_r = [], [], []
            for n in range(first, min(first + 2000, sessions + 1)):
                long = n == sessions
                sid = LONG_SESSION if long else f"s{n:06d}"
                k = 50 if long else rng.randint(1, 5)
                when = start + timedelta(seconds=n * 6)
                model = MODELS[n % len(MODELS)]
                prefix, parent, tokens = 0, None, 0
                for seq in range(k):
                    prompt = [rng.randrange(100, 49000) for _ in range(300 if long else rng.randint(20, 80))]
                    sampled = [rng.randrange(100, 49000) for _ in range(100 if long else rng.randint(5, 30))]
                    drawn = [rng.choice(words) for _ in range(12)]
                    if rng.random() < 0.001:
                        drawn[rng.randrange(12)] = RARE
                    text = " ".join(drawn)
                    rows_c.append(_call(sid, seq, parent, prefix, prompt, sampled, when, model, text))
                    parent, prefix, tokens = f"{sid}-c{seq}-0", prefix + len(prompt) + len(sampled), \
                        tokens + len(prompt) + len(sampled)
                reward = round(rng.random(), 3) if rng.random() < 0.8 else None
                rows_s.append({"id": sid, "group_id": sid[:6], "status": "final" if reward is not None else "open",
                               "owner": None, "created_at": when, "updated_at": when, "model": model, "calls": k,
                               "tokens": tokens, "reward": reward, "reward_override": None, "excluded": False})
                if reward is not None:
                    rows_r.append({"session_id": sid, "call_id": None, "value": reward, "components": None,
                                   "final": True, "idempotency_key": None, "created_at": when})
            conn.execute(insert(AgentSession.__table__), rows_s)  # type: ignore[attr-defined]
            conn.execute(insert(Call.__table__), rows_c)  # type: ignore[attr-defined]
            if rows_r:
                conn.execute(insert(Reward.__table__), rows_r)  # type: ignore[attr-defined]
            progress.update(task, advance=len(rows_s))
    if engine.dialect.name == "postgresql":
        # The planner's statistics, as autovacuum keeps them for a store that grew over time (not right
        # after a bulk load): without them it misjudges how common a searched word is.
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
    engine.dispose()


SEARCH = "search:"
"""A `session` argument starting with this is the sessions page filtered by the text after it."""


def page_requests(base: str, session: str | None) -> list[str]:
    if session is None:
        return [f"{base}/v1/whoami", f"{base}/v1/sessions?limit=50"]
    if session.startswith(SEARCH):
        return [f"{base}/v1/whoami", f"{base}/v1/sessions?limit=50&q={session.removeprefix(SEARCH)}"]
    return [f"{base}/v1/sessions/{session}", f"{base}/v1/sessions/{session}/trajectory?text=true",
            f"{base}/v1/sessions/{session}/actions"]


def server_times(base: str, session: str | None, repeats: int) -> list[float]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    times = []
    with httpx.Client(timeout=60, headers=headers) as client:
        for _ in range(repeats):
            total = 0.0
            for url in page_requests(base, session):
                began = time.perf_counter()
                client.get(url).raise_for_status()
                total += time.perf_counter() - began
            times.append(total)
    return times


def browser_times(base: str, repeats: int) -> dict[str, list[float]] | None:
    """Navigation to the page's content in the DOM, per page; None without chromium and playwright."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if not Path("/usr/bin/chromium").exists():
        return None
    pages = {"sessions page": (f"{base}/ui/#/sessions", "table#sessions tbody tr"),
             f"{LONG_SESSION} page": (f"{base}/ui/#/session/{LONG_SESSION}", ".tok.sampled")}
    out: dict[str, list[float]] = {name: [] for name in pages}
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=args)
        context = browser.new_context()
        context.add_cookies([{"name": "tt_console_key", "value": ADMIN, "url": f"{base}/ui/"}])
        page = context.new_page()
        for _ in range(repeats):
            for name, (url, selector) in pages.items():
                page.goto("about:blank")
                began = time.perf_counter()
                page.goto(url)
                page.wait_for_selector(selector, timeout=60_000)
                out[name].append(time.perf_counter() - began)
        browser.close()
    return out


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"{1000 * statistics.median(values):.0f} / {1000 * p95:.0f}"


@contextmanager
def store_url(store: str, tmp: Path) -> Iterator[str]:
    """An empty store of the kind named: a SQLite file, or a database in a throwaway PostgreSQL cluster."""
    if store == "sqlite":
        yield f"sqlite:///{tmp / 'store.db'}"
        return
    with postgres(fsync=True) as create_database:
        yield create_database("console")


def measure(db_url: str, args: argparse.Namespace, label: str) -> ResultTable:
    """Fill the store, serve it, and time each page."""
    began = time.perf_counter()
    fill(db_url, args.sessions, args.seed)
    console.print(f"{label}: filled in {time.perf_counter() - began:.0f} s")
    port = free_port()
    cmd = python_cmd("-m", "tracetrain.cli", "serve", "--engine", "transformers", "--db-url", db_url,
                     "--port", str(port), "--set", f"admin_key={ADMIN}", "--set", 'api_keys=["bench-agent"]')
    gateway = ServerProcess("console-gateway", cmd, f"http://127.0.0.1:{port}").start(timeout=300)
    searches = {f"sessions page, text search '{COMMON}' (common)": f"{SEARCH}{COMMON}",
                f"sessions page, text search '{RARE}' (rare)": f"{SEARCH}{RARE}"}
    try:
        server_times(gateway.url, None, 2)  # warm the caches the way a browser's first visit would not
        timed = {"sessions page": server_times(gateway.url, None, args.repeats),
                 f"{LONG_SESSION} page": server_times(gateway.url, LONG_SESSION, args.repeats)}
        for name, session in searches.items():
            server_times(gateway.url, session, 1)  # the first search after start-up warms the index's pages
            timed[name] = server_times(gateway.url, session, args.repeats)
        browser = browser_times(gateway.url, args.repeats)
    finally:
        gateway.stop()
    table = ResultTable(f"{label}: console pages with {args.sessions:,} sessions in the store (ms, median / p95 of "
                        f"{args.repeats})", ["page", "server time", "target < 500 ms", "first render in chromium"])
    for name, values in timed.items():
        render = (_ms(browser[name]) if name in browser else "not measured") if browser else "chromium not installed"
        table.add(name, _ms(values), "yes" if statistics.median(values) < 0.5 else "NO", render)
    console.print(table.rich())
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.console_render", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--stores", default=",".join(STORES), help=f"comma-separated of {', '.join(STORES)}")
    p.add_argument("--db-url", help="an empty store of yours to fill, in place of --stores")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="console_render")
    args = p.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    if set(stores) - set(STORES):
        p.error(f"--stores takes {', '.join(STORES)}")
    if "postgresql" in stores and shutil.which("initdb") is None:
        console.print("[yellow]initdb not found: skipping PostgreSQL")
        stores.remove("postgresql")
    console.print(machine_line())
    tables = []
    if args.db_url:
        tables.append(measure(args.db_url, args, args.db_url.split(":", 1)[0].split("+")[0]))
    for store in [] if args.db_url else stores:
        tmp = Path(tempfile.mkdtemp(prefix="tt-console-"))
        try:
            with store_url(store, tmp) as url:
                tables.append(measure(url, args, STORES[store]))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a 100k-session store is a few hundred MB
    notes = [f"stores: {', '.join(t.title.split(':', 1)[0] for t in tables)}; {args.sessions:,} sessions of 1-5 calls "
             f"plus `{LONG_SESSION}` (50 calls, about 20k tokens), written straight into the tables; PostgreSQL "
             "in a throwaway cluster with its durable defaults",
             "server time: the page's JSON requests one after another over loopback HTTP, summed; the sessions page "
             "is the default view (newest first, 50 rows); the session page includes every token's text; the text "
             f"searches match the stored messages and replies: '{COMMON}' is in about 3 of 4 messages, "
             f"'{RARE}' in 1 of 1,000",
             "first render: chromium from navigation until the rows (sessions) or the sampled tokens (session) are "
             "in the DOM, the key already in the cookie"]
    command = " ".join(["python -m bench.console_render", *(argv if argv is not None else sys.argv[1:])])
    path = write_results(args.output, "Console render times", command, tables, notes)
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
