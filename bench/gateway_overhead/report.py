"""The report: the gateway against direct per configuration, each target's detail, the first gateway's CPU
by thread, the store check and the targets, as tables; and the notes that say how the run was set up."""

from __future__ import annotations

import argparse
from collections import Counter

from bench.common import ResultTable
from bench.gateway_overhead.cpu import THREAD_CPU_PARTS
from bench.gateway_overhead.load import Key, Plan, Stats, Target
from bench.gateway_overhead.servers import commit_of
from bench.gateway_overhead.store_check import StoreCheck

TARGET_ADDED_P50_MS = 2.0
TARGET_THROUGHPUT_SHARE = 0.9
"""bench/README.md's targets at concurrency 16: what the gateway may add to direct."""


def _ms(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}"


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _mode(stream: bool) -> str:
    return "stream" if stream else "non-stream"


def report(
    results: dict[Key, Stats], plan: Plan, check: StoreCheck, upstream: str, vias: list[Target]
) -> list[ResultTable]:
    summary = ResultTable(
        f"Gateway overhead vs direct ({upstream} upstream; direct is always its chat completions)",
        [
            "mode",
            "conc",
            "gateway API",
            "direct req/s",
            "gateway req/s",
            "gw/direct",
            "added p50 ms",
            "added p99 ms",
            "added TTFT p50 ms",
            "gateway CPU ms/req",
            "errors d/gw",
        ],
    )
    detail = ResultTable(
        "Per target (CPU ms/req: CPU time of each process during the target's phases / requests)",
        [
            "mode",
            "conc",
            "target",
            "ok",
            "req/s",
            "p50 ms",
            "p99 ms",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "tokens/req",
            "CPU gateway",
            "gateway CPU min–max over rounds",
            "CPU upstream",
            "CPU loadgen",
        ],
    )
    for stream in plan.streams:
        for c in plan.concurrencies:
            d = results[(stream, c, "direct")]
            for via in vias:
                g = results[(stream, c, via.name)]
                summary.add(
                    _mode(stream),
                    c,
                    via.name.removeprefix("gateway "),
                    _rate(d.rps),
                    _rate(g.rps),
                    f"{g.rps / d.rps:.0%}" if d.rps else "n/a",
                    _ms(g.latency_ms(50) - d.latency_ms(50)),
                    _ms(g.latency_ms(99) - d.latency_ms(99)),
                    _ms(g.ttft_ms(50) - d.ttft_ms(50)) if stream else "",
                    _ms(g.cpu_ms_per_request(via.meter)),
                    f"{sum(d.errors.values())}/{sum(g.errors.values())}",
                )
            meters = {via.name: via.meter for via in vias}
            for name in ["direct", *meters]:
                t = results[(stream, c, name)]
                detail.add(
                    _mode(stream),
                    c,
                    name,
                    len(t.samples),
                    _rate(t.rps),
                    _ms(t.latency_ms(50)),
                    _ms(t.latency_ms(99)),
                    _ms(t.ttft_ms(50)) if stream else "",
                    _ms(t.ttft_ms(99)) if stream else "",
                    f"{t.tokens_per_request():.1f}",
                    _ms(t.cpu_ms_per_request(meters[name])) if name != "direct" else "",
                    t.cpu_spread(meters[name]) if name != "direct" else "",
                    _ms(t.cpu_ms_per_request("upstream")),
                    _ms(t.cpu_ms_per_request("loadgen")),
                )
    threads = ResultTable(
        "Gateway CPU by thread, ms/req (the first gateway's processes: the event loop's thread, the others; "
        "user and system time)",
        ["mode", "conc", "target", *THREAD_CPU_PARTS, "total"],
    )
    for stream in plan.streams:
        for c in plan.concurrencies:
            for via in vias:
                if via.meter == "gateway":
                    t = results[(stream, c, via.name)]
                    parts = [t.cpu_ms_per_request(f"gateway {part}") for part in THREAD_CPU_PARTS]
                    threads.add(_mode(stream), c, via.name, *map(_ms, parts), _ms(sum(parts)))
    store = ResultTable(
        "Store check: every completion id the load generator got from the gateway, looked up in `calls`",
        ["received ids", "found in calls", "missing from store", "wrong completion_tokens", "links"],
        right_align_from=0,
    )
    wrong = "n/a" if check.wrong_tokens is None else check.wrong_tokens
    store.add(check.received, check.stored, check.missing, wrong, check.links)
    targets = ResultTable("Targets", ["target", "measured", "met"])
    if 16 in plan.concurrencies and any(via.name == gateway_name("chat") for via in vias):
        for stream in plan.streams:
            d, g = results[(stream, 16, "direct")], results[(stream, 16, gateway_name("chat"))]
            added = g.latency_ms(50) - d.latency_ms(50)
            ratio = g.rps / d.rps if d.rps else float("nan")
            targets.add(f"added p50 < {TARGET_ADDED_P50_MS:g} ms at c=16 ({_mode(stream)})", f"{added:.2f} ms",
                        _yes(added < TARGET_ADDED_P50_MS))
            targets.add(f"throughput >= {TARGET_THROUGHPUT_SHARE:.0%} of direct at c=16 ({_mode(stream)})",
                        f"{ratio:.0%}", _yes(ratio >= TARGET_THROUGHPUT_SHARE))
    targets.add("missing from store: 0", str(check.missing), _yes(check.missing == 0))
    tables = [summary, detail, threads, store, targets]
    errors: Counter[str] = Counter()
    for t in results.values():
        errors.update(t.errors)
    if errors:
        table = ResultTable("Errors", ["error", "count"])
        for message, count in errors.most_common(10):
            table.add(message, count)
        tables.append(table)
    return tables


def gateway_name(api: str) -> str:
    return f"gateway {api}"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def notes(args: argparse.Namespace, plan: Plan, targets: int, elapsed_s: float, worker_counts: list[int],
          gateway_env: dict[str, str]) -> list[str]:
    """How the run was set up, for the results file."""
    turns = f"{args.turns} requests each" if args.sessions == "multiturn" else "a new session for every request"
    lines = [
        f"sessions: {args.sessions} ({turns}); answers of {args.max_tokens} tokens; user messages of "
        f"{args.prompt_words} words; {plan.rounds} alternating direct/gateway rounds per config; "
        f"load phases took {elapsed_s:.0f} s",
        "direct = the upstream's own /v1/chat/completions; gateway <api> = /s/<session>/v1/chat/completions, "
        "/v1/responses or /v1/messages with the same conversation in that API's shape (chat template + "
        "tokenizer, upstream /v1/completions with token ids, store commit before answering)",
        f"targets per round: direct + {targets} gateway targets, their order rotated every round",
        "added = gateway percentile minus direct percentile; TTFT = until the first SSE event carrying text",
        "one machine with shared, partly stolen cores: compare within a run, not across runs",
    ]
    if args.gateway_src:
        lines.append(f"gateway source: {args.gateway_src}" + commit_of(args.gateway_src))
    if args.baseline_src:
        lines.append(f"baseline gateway source: {args.baseline_src}" + commit_of(args.baseline_src)
                     + "; its own store of the same kind")
    if len(worker_counts) > 1:
        lines.append(f"gateway ×N = `serve --workers N` on its own SQLite store; gateways with "
                     f"{', '.join(map(str, worker_counts))} processes, interleaved with direct in every round")
    if gateway_env:
        lines.append(f"gateway environment: {gateway_env}")
    return lines


def raw(results: dict[Key, Stats], check: StoreCheck, args: argparse.Namespace) -> dict[str, object]:
    """The measurements behind the tables, per (mode, concurrency, target), for the results' JSON."""
    return {
        "arguments": {k: str(v) if v is not None else None for k, v in vars(args).items()},
        "targets": [{"mode": _mode(stream), "concurrency": c, "target": name, **stats.record()}
                    for (stream, c, name), stats in results.items()],
        "store_check": check.record(),
    }
