"""What the gateway adds on top of the engine: latency, time to first token and throughput.

Three processes: the upstream (the fixed-output `bench.fixed_upstream`, or real vLLM CPU with
`--upstream vllm`), the gateway (`python -m tracetrain.cli serve --engine vllm --engine-url …`, with a
fresh SQLite store), and this one, the load generator. For each concurrency and for non-streaming and
streaming requests, the same workload goes

- direct: to the upstream's own `/v1/chat/completions`, and
- gateway <api>: to the gateway's `/s/<session>/v1/chat/completions`, `/v1/responses` and
  `/v1/messages` (`--apis`), the same conversation in each API's shape; the gateway renders the chat
  template, calls the upstream's `/v1/completions` with token ids and commits the call before
  answering, so the APIs differ only in their protocol layer.

Phases run in rounds whose target order rotates (D C R M, C R M D, …) so that background load on the
machine hits every target alike; compare the columns of one run, not runs with each other. Sessions: `--sessions
unique` (default) gives every request its own new session; `--sessions multiturn` runs one
conversation per client connection that grows for `--turns` turns (each request extends the previous
reply, exercising the token chain), then starts a new session. Afterwards every completion id the load
generator received from the gateway is looked up in the store's `calls` table.

    python -m bench.gateway_overhead                   # fixed upstream, concurrency 1, 16, 64
    python -m bench.gateway_overhead --upstream vllm   # real vLLM CPU, small counts
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.apis import APIS, Api, Turn
from bench.client import Connection, HTTPFailure
from bench.common import (
    OUT_DIR,
    REPO_ROOT,
    THREAD_CPU_PARTS,
    ResultTable,
    ServerProcess,
    console,
    free_port,
    group_cpu_seconds,
    group_pids,
    machine_line,
    percentile,
    python_cmd,
    self_cpu_seconds,
    thread_cpu_seconds,
    write_results,
)

MODEL_NAME = "smollm2-135m-instruct"
ANSWER_TEXT = (
    "The quick brown fox jumps over the lazy dog while the old cat watches it from the warm "
    "windowsill, and the story goes on and on without end."
)
WORDS = [
    "agent",
    "tool",
    "call",
    "result",
    "search",
    "file",
    "read",
    "write",
    "plan",
    "step",
    "check",
    "answer",
    "question",
    "model",
    "token",
    "prompt",
    "reward",
    "session",
    "trace",
    "store",
    "batch",
    "query",
    "table",
    "index",
    "value",
    "error",
    "retry",
    "limit",
    "cache",
    "update",
    "version",
    "policy",
    "train",
    "sample",
    "score",
    "review",
    "branch",
    "merge",
    "commit",
    "deploy",
    "build",
    "test",
]
SYSTEM_PROMPT = (
    "You are a careful coding agent. Think step by step, call tools when they help, and "
    "answer concisely. Never invent file contents; read them first."
)


# ---------------------------------------------------------------- workload


@dataclass
class Workload:
    tag: str
    """Unique per run, so that session ids never collide with an earlier run's."""
    max_tokens: int
    prompt_words: int
    turns: int
    """Requests per session: 1 for unique sessions."""
    temperature: float | None = None
    long_answer_prompt: bool = False
    """vLLM: ask for a long text, so both paths run to max_tokens rather than an early EOS."""

    def user_text(self, n: int) -> str:
        # One word in eight carries a number never sent before ("trace48213"), as ids, paths and counts do
        # in agents' messages: the gateway remembers words it has encoded (proxy/segments.py), and a
        # message of 42 words seen before would measure that cache, not the encoding.
        words = [WORDS[(n * 7 + i * 13) % len(WORDS)] + (str(n * 1009 + i) if i % 8 == 7 else "")
                 for i in range(self.prompt_words)]
        lead = "Write a long story about these words, never stopping: " if self.long_answer_prompt else ""
        return f"{lead}Request {n}: " + " ".join(words)


_session_numbers = itertools.count()
_request_numbers = itertools.count()


class Conversation:
    """The messages one client sends: a new session every `turns` requests."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.session = ""
        self.turns: list[Turn] = []
        self.turn = 0
        self._new()

    def _new(self) -> None:
        self.session = f"{self.workload.tag}-{next(_session_numbers)}"
        self.turns: list[Turn] = [("user", self.workload.user_text(next(_request_numbers)))]
        self.turn = 0

    def body(self, api: Api, stream: bool) -> dict[str, Any]:
        """The conversation so far in `api`'s request shape (the system prompt where that API puts it)."""
        body = api.body(SYSTEM_PROMPT, self.turns, self.workload.max_tokens, stream, self.workload.temperature)
        body["model"] = MODEL_NAME
        return body

    def advance(self, reply_text: str) -> None:
        self.turn += 1
        if self.turn >= self.workload.turns:
            self._new()
            return
        self.turns = [*self.turns, ("assistant", reply_text), ("user", self.workload.user_text(next(_request_numbers)))]


# ---------------------------------------------------------------- targets and phases


@dataclass
class Target:
    name: str
    host: str
    port: int
    via_gateway: bool
    api: Api
    meter: str = "gateway"
    """Which gateway the target goes to, and whose CPU its phases charge: `gateway`, `gateway ×4` for the
    4-process gateway of `--gateway-workers 1,4`, or `baseline` for the `--baseline-src` gateway."""

    def path(self, session: str) -> str:
        return f"/s/{session}{self.api.path}" if self.via_gateway else self.api.path


@dataclass
class Sample:
    latency_s: float
    first_token_s: float | None
    completion_id: str
    completion_tokens: int


@dataclass
class Stats:
    """All samples of one (target, stream, concurrency) across its rounds."""

    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each process (gateway, upstream, loadgen) spent during this target's phases."""
    phase_cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    """Each phase's CPU ms per request, by process: the spread across rounds."""

    @property
    def rps(self) -> float:
        return len(self.samples) / self.wall_s if self.wall_s else float("nan")

    def latency_ms(self, q: float) -> float:
        return percentile([s.latency_s for s in self.samples], q) * 1000

    def ttft_ms(self, q: float) -> float:
        values = [s.first_token_s for s in self.samples if s.first_token_s is not None]
        return percentile(values, q) * 1000

    def tokens_per_request(self) -> float:
        return sum(s.completion_tokens for s in self.samples) / max(1, len(self.samples))

    def cpu_spread(self, process: str) -> str:
        values = self.phase_cpu_ms.get(process) or []
        return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else ""

    def cpu_ms_per_request(self, process: str) -> float:
        if not self.samples or process not in self.cpu_s:
            return float("nan")
        return 1000 * self.cpu_s[process] / len(self.samples)


@dataclass
class Plan:
    concurrencies: list[int]
    requests: int
    requests_serial: int
    rounds: int
    warmup: int
    streams: list[bool]
    phase_timeout_s: float
    request_timeout_s: float

    def count(self, concurrency: int) -> int:
        return self.requests_serial if concurrency == 1 else self.requests


Key = tuple[bool, int, str]
"""(stream, concurrency, target name)."""


class LoadRunner:
    """Runs the phases; `received` collects, per gateway (its meter), every completion id it answered with."""

    def __init__(self, plan: Plan, workload: Workload, meters: dict[str, Callable[[], float]]) -> None:
        self.plan = plan
        self.workload = workload
        self.meters = meters
        self.received: dict[str, set[str]] = {}
        self.done = 0

    async def phase(
        self, target: Target, *, stream: bool, concurrency: int, requests: int, stats: Stats
    ) -> None:
        """`requests` requests over `concurrency` keep-alive connections, recorded into `stats`."""
        remaining = requests
        stop_at = time.perf_counter() + self.plan.phase_timeout_s

        async def client() -> None:
            nonlocal remaining
            conn = Connection(target.host, target.port)
            conversation = Conversation(self.workload)
            try:
                while remaining > 0 and time.perf_counter() < stop_at:
                    remaining -= 1
                    path, body = target.path(conversation.session), conversation.body(target.api, stream)
                    try:
                        post = conn.post(path, body, stream=stream)
                        reply = await asyncio.wait_for(post, self.plan.request_timeout_s)
                        if reply.status != 200:
                            raise HTTPFailure(f"HTTP {reply.status}: {reply.body[:200]!r}")
                        completion_id, text, tokens = target.api.parse(reply, stream)
                    except (HTTPFailure, TimeoutError, KeyError, ValueError) as exc:
                        stats.errors[str(exc)[:120] or type(exc).__name__] += 1
                        await conn.close()
                        conversation = Conversation(self.workload)
                        continue
                    finally:
                        self.done += 1
                    stats.samples.append(Sample(reply.latency_s, reply.first_token_s, completion_id, tokens))
                    if target.via_gateway:  # each gateway's store is checked afterwards
                        self.received.setdefault(target.meter, set()).add(completion_id)
                    conversation.advance(text)
            finally:
                await conn.close()

        cpu_before = {name: meter() for name, meter in self.meters.items()}
        started, answered = time.perf_counter(), len(stats.samples)
        await asyncio.gather(*(client() for _ in range(concurrency)))
        stats.wall_s += time.perf_counter() - started
        answered = len(stats.samples) - answered
        for name, meter in self.meters.items():
            spent = meter() - cpu_before[name]
            stats.cpu_s[name] = stats.cpu_s.get(name, 0.0) + spent
            if answered:
                stats.phase_cpu_ms.setdefault(name, []).append(1000 * spent / answered)
        if remaining > 0:
            stats.errors[f"phase deadline ({self.plan.phase_timeout_s:.0f} s) hit: {remaining} not sent"] += 1

    async def run(self, targets: list[Target]) -> dict[Key, Stats]:
        """Warm-up, then per config rounds whose target order rotates: D G, G D, … (D A B C, A B C D, …)."""
        plan = self.plan
        results: dict[Key, Stats] = {}
        configs = [(s, c) for s in plan.streams for c in plan.concurrencies]
        n = len(targets)
        total = sum(plan.count(c) * n for _, c in configs) + plan.warmup * n * len(plan.streams)
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, refresh_per_second=4) as progress:
            task = progress.add_task("warm-up", total=total)

            async def ticker() -> None:
                while True:
                    progress.update(task, completed=self.done)
                    await asyncio.sleep(0.25)

            tick = asyncio.create_task(ticker())
            try:
                for stream in plan.streams:
                    for target in targets:
                        warm = min(4, max(1, plan.warmup))
                        await self.phase(
                            target, stream=stream, concurrency=warm, requests=plan.warmup, stats=Stats()
                        )
                for stream, concurrency in configs:
                    per_round = max(1, plan.count(concurrency) // plan.rounds)
                    for r in range(plan.rounds):
                        for target in targets[r % n :] + targets[: r % n]:
                            mode = "stream" if stream else "non-stream"
                            label = f"{mode} c={concurrency} round {r + 1}/{plan.rounds}: {target.name}"
                            progress.update(task, description=label)
                            stats = results.setdefault((stream, concurrency, target.name), Stats())
                            await self.phase(
                                target,
                                stream=stream,
                                concurrency=concurrency,
                                requests=per_round,
                                stats=stats,
                            )
                progress.update(task, completed=self.done, description="done")
            finally:
                tick.cancel()
        return results


# ---------------------------------------------------------------- store check


@dataclass
class StoreCheck:
    received: int
    stored: int
    missing: int
    wrong_tokens: int | None
    links: str
    """How the received calls joined their sessions, e.g. `start 170, extend 850`."""


def check_store(db_url: str, received: set[str], expected_tokens: int | None) -> StoreCheck:
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT completion_id, completion_tokens, link FROM calls")).all()
    finally:
        engine.dispose()
    stored = {row[0] for row in rows}
    wrong = None
    if expected_tokens is not None:
        wrong = sum(1 for cid, tokens, _ in rows if cid in received and tokens != expected_tokens)
    links = Counter(link for cid, _, link in rows if cid in received)
    described = ", ".join(f"{link} {count}" for link, count in links.most_common())
    return StoreCheck(len(received), len(stored & received), len(received - stored), wrong, described)


def check_stores(db_urls: dict[str, str], received: dict[str, set[str]], expected_tokens: int | None) -> StoreCheck:
    """`check_store` for each gateway (by meter) on its own store, added up."""
    checks = [check_store(url, received.get(meter, set()), expected_tokens) for meter, url in db_urls.items()]
    wrong = None if expected_tokens is None else sum(c.wrong_tokens or 0 for c in checks)
    links = "; ".join(f"{meter}: {c.links}" for meter, c in zip(db_urls, checks, strict=True)) if len(checks) > 1 \
        else checks[0].links
    return StoreCheck(sum(c.received for c in checks), sum(c.stored for c in checks),
                      sum(c.missing for c in checks), wrong, links)


# ---------------------------------------------------------------- servers


def fixed_answer(model_dir: Path, tokens: int) -> dict[str, Any]:
    """The fixed upstream's answer in the model's real token ids: `tokens - 1` text tokens + EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = list(tokenizer.encode(ANSWER_TEXT, add_special_tokens=False))[: tokens - 1]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces: list[str] = []
    prev = ""
    for i in range(len(ids)):
        text = str(tokenizer.decode(ids[: i + 1]))
        pieces.append(text[len(prev) :])
        prev = text
    names = [tokenizer.decode([t]) for t in ids]
    return {
        "token_ids": [*ids, eos],
        "pieces": [*pieces, ""],
        "tokens": [*names, "<|im_end|>"],
        "ends_with_eos": True,
    }


def start_gateway(
    upstream_url: str,
    model_dir: Path,
    db_url: str,
    env: dict[str, str],
    src: Path | None,
    workers: int = 1,
    one_socket_per_worker: bool = True,
) -> ServerProcess:
    """`tracetrain serve` in front of the upstream; from the source tree `src` when given. With several
    workers, returns once each listens (`one_socket_per_worker=False`, for a source tree older than
    `proxy/processes.py` whose workers share one socket: once each worker process exists, plus 10 s)."""
    port = free_port()
    options = {
        "--engine": "vllm",
        "--engine-url": upstream_url,
        "--model": str(model_dir),
        "--served-model-name": MODEL_NAME,
        "--db-url": db_url,
        "--port": str(port),
        "--workers": str(workers),
    }
    cmd = python_cmd("-m", "tracetrain.cli", "serve", *[x for pair in options.items() for x in pair])
    if src is not None:
        inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(src), inherited) if p)}
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess("gateway", cmd, url, env=env, cwd=src).start(timeout=120)
    if workers > 1 and one_socket_per_worker:
        wait_for_listeners(port, workers)
    elif workers > 1:
        import psutil

        while len(psutil.Process(server.pid).children()) < workers:
            time.sleep(0.2)
        time.sleep(10)
    return server


def wait_for_listeners(port: int, n: int, timeout_s: float = 120) -> None:
    """Until `n` processes listen on `port`. /health answers once the first worker listens; a connection
    opened before the others do stays on the workers already up, so a measurement would not use them all."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        pids = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        if len(pids) >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} of {n} gateway workers listening after {timeout_s:.0f} s")
        time.sleep(0.2)


def pin(pgid: int, cpus: set[int]) -> None:
    """Every thread of process group `pgid` onto `cpus`; threads started later inherit their creator's."""
    for pid in group_pids(pgid):
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(task.name), cpus)
        except OSError:
            continue


class Profiler:
    """py-spy attached to the gateway, writing folded stacks; summarised into tables afterwards."""

    def __init__(self, py_spy: str, pid: int, rate: int) -> None:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        self.path = OUT_DIR / "gateway_profile.folded"
        options = f"record --rate {rate} --nonblocking --gil --format raw".split()
        command = [py_spy, *options, "--pid", str(pid), "--output", str(self.path)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> Path:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.path


CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    # Markers match py-spy's frames, `function (path/file.py:line)`.
    ("store: group commit (writer thread)", ("_commit (tracetrain/store/writer.py",)),
    ("store: reads (session lookup, chain load)",
     ("_read (tracetrain/proxy/gateway.py", "_load_node (", "_load_session (", "_load_latest (")),
    ("engine: request to the upstream + parse", ("(tracetrain/engines/vllm.py", "(tracetrain/engines/replicas.py")),
    ("prompt: chat template + tokenizer", ("(tracetrain/proxy/render.py", "(tracetrain/proxy/segments.py")),
    ("history hashes, canonical messages, group", ("history_hashes (", "canonical_message (", "prompt_group (")),
    ("record: rows, submit, caches", ("record (tracetrain/proxy/serving.py",)),
    ("stream: events to the client", ("_stream (tracetrain/proxy/routes", "text_pieces (",
                                      "(tracetrain/proxy/event_stream.py")),
    ("other route code (bind, plan, reply, response)", ("(tracetrain/proxy/",)),
    ("FastAPI: body parse, validation, response", ("solve_dependencies (", "serialize_response (",
                                                   "request_body_to_args (")),
    ("logging", ("(logging/",)),
    ("uvicorn, starlette, asyncio loop, aiohttp callbacks, other", ()),
]
"""Where a sample goes: the first category one of whose markers appears in its stack."""


def _frame_name(frame: str) -> str:
    """`func (path/file.py:123)` -> `func (path/file.py)`."""
    name, _, where = frame.rpartition(" (")
    return f"{name} ({where.rstrip(')').rsplit(':', 1)[0]})"


def profile_tables(folded: Path, top: int) -> list[ResultTable]:
    """Self time per function and a breakdown of the gateway's time by activity."""
    self_time: Counter[str] = Counter()
    category: Counter[str] = Counter()
    total = 0
    for line in folded.read_text(errors="replace").splitlines():  # py-spy may cut a name mid-character
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        self_time[_frame_name(stack.rsplit(";", 1)[-1])] += count
        label = next(name for name, markers in CATEGORIES if not markers or any(m in stack for m in markers))
        category[label] += count
    if not total:
        return []
    by_category = ResultTable(
        f"Gateway profile: where the time goes ({total} samples of the thread holding the GIL; C code "
        "that releases it, SQLite's statements and fsync among it, is not counted)",
        ["activity (first match in the stack)", "% of samples"],
    )
    for name, _ in CATEGORIES:
        by_category.add(name, f"{100 * category[name] / total:.1f}")
    by_self = ResultTable(f"Gateway profile: self time, top {top}", ["function", "self %"])
    for name, count in self_time.most_common(top):
        by_self.add(name, f"{100 * count / total:.1f}")
    return [by_category, by_self]


# ---------------------------------------------------------------- report


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
            targets.add(f"added p50 < 2 ms at c=16 ({_mode(stream)})", f"{added:.2f} ms", _yes(added < 2))
            targets.add(
                f"throughput >= 90% of direct at c=16 ({_mode(stream)})", f"{ratio:.0%}", _yes(ratio >= 0.9)
            )
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


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--upstream",
        choices=["fixed", "vllm", "torch"],
        default="fixed",
        help="fixed-output server (default), real vLLM CPU on SmolLM2, or `bench.torch_upstream` (transformers' "
        "continuous batching, for a GPU without vLLM)",
    )
    p.add_argument("--torch-device", default="cuda", help="--upstream torch: the device it generates on")
    p.add_argument(
        "--torch-random-weights",
        action="store_true",
        help="--upstream torch: SmolLM2's architecture with random weights (same work per token), where the "
        "weights cannot be copied",
    )
    p.add_argument(
        "--gateway-workers",
        default="1",
        help="comma-separated process counts (`serve --workers N`): one gateway per count, each on its own "
        "store, interleaved as targets (default 1)",
    )
    p.add_argument(
        "--upstream-url",
        help="use the server already running here instead of starting one (with --upstream vllm: a vLLM "
        f"serving the SmolLM2 directory as '{MODEL_NAME}')",
    )
    p.add_argument("--concurrency", help="comma-separated client connections (default 1,16,64; vllm: 1,16)")
    p.add_argument(
        "--requests", type=int, help="per target and config at concurrency > 1 (default 1000; vllm: 48)"
    )
    p.add_argument("--requests-serial", type=int, help="per target at concurrency 1 (default 200; vllm: 12)")
    p.add_argument(
        "--rounds", type=int, default=2, help="alternating direct/gateway rounds per config (default 2)"
    )
    p.add_argument("--warmup", type=int, help="warm-up requests per target and mode (default 100; vllm: 4)")
    p.add_argument("--mode", choices=["both", "non-stream", "stream"], default="both")
    p.add_argument(
        "--apis",
        default="chat,responses,messages",
        help="gateway APIs to measure, each against the same direct chat baseline (default: all three)",
    )
    p.add_argument(
        "--sessions",
        choices=["unique", "multiturn"],
        default="unique",
        help="a new session per request (default), or growing conversations",
    )
    p.add_argument("--turns", type=int, default=6, help="requests per session with --sessions multiturn")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (fixed: the answer length)")
    p.add_argument("--prompt-words", type=int, default=150, help="words in each user message (default 150)")
    p.add_argument("--upstream-workers", type=int, default=1, help="uvicorn workers of the fixed upstream")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="fixed upstream: pause per token")
    p.add_argument("--db-url", help="gateway store (default: a fresh SQLite file in a temporary directory)")
    p.add_argument(
        "--gateway-src",
        type=Path,
        help="run the gateway from this source tree (a directory holding `tracetrain/`, e.g. a `git archive` "
        "snapshot) instead of the working tree",
    )
    p.add_argument(
        "--baseline-src",
        type=Path,
        help="also start a second gateway from this source tree (e.g. a `git archive` of the last commit) "
        "on its own store, and interleave its targets with the working tree's: an A/B in one run",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="GATEWAY=CPUS",
        help="run a gateway's processes on these CPUs only, e.g. `gateway=2` or `baseline=2,3` (repeatable): "
        "with --baseline-src set to a copy of the same tree, pinned against unpinned",
    )
    p.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the gateway, e.g. TRACETRAIN_SQLITE_SYNCHRONOUS=NORMAL (repeatable)",
    )
    p.add_argument(
        "--phase-timeout", type=float, default=180.0, help="stop sending in a phase after this (s)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="attach py-spy to the gateway and break down where its time goes (skews timings)",
    )
    p.add_argument(
        "--py-spy",
        default=os.environ.get("PY_SPY") or shutil.which("py-spy") or "",
        help="py-spy executable (default: $PY_SPY, then PATH)",
    )
    p.add_argument(
        "--output", help="results file under bench/results, without .md (default from the options)"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    vllm = args.upstream == "vllm"
    plan = Plan(
        concurrencies=[int(c) for c in (args.concurrency or ("1,16" if vllm else "1,16,64")).split(",")],
        requests=args.requests or (48 if vllm else 1000),
        requests_serial=args.requests_serial or (12 if vllm else 200),
        rounds=max(1, args.rounds),
        warmup=args.warmup if args.warmup is not None else (4 if vllm else 100),
        streams={"both": [False, True], "non-stream": [False], "stream": [True]}[args.mode],
        phase_timeout_s=args.phase_timeout,
        request_timeout_s=300.0 if vllm else 60.0,
    )
    workload = Workload(
        tag=f"bench{int(time.time())}",
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        turns=args.turns if args.sessions == "multiturn" else 1,
        temperature=0.0 if vllm else None,
        long_answer_prompt=vllm,
    )
    if args.profile and not args.py_spy:
        raise SystemExit("--profile needs py-spy (pip install py-spy, or --py-spy PATH)")
    gateway_env = dict(item.split("=", 1) for item in args.gateway_env)
    worker_counts = [int(w) for w in args.gateway_workers.split(",")]
    if args.db_url and len(worker_counts) > 1:
        raise SystemExit("--db-url names one store; several --gateway-workers counts each need their own")
    apis = args.apis.split(",")
    pins = {name: {int(c) for c in cpus.split(",")} for name, _, cpus in (p.partition("=") for p in args.pin)}
    if unknown := set(pins) - {"gateway", "baseline"}:
        raise SystemExit(f"--pin: unknown gateway {sorted(unknown)}; name `gateway` or `baseline`")
    if missing := set().union(*pins.values()) - os.sched_getaffinity(0):
        raise SystemExit(f"--pin: this machine has no CPU {sorted(missing)} for this process")
    if unknown := set(apis) - set(APIS):
        raise SystemExit(f"--apis: unknown {sorted(unknown)}; choose from {sorted(APIS)}")

    from tracetrain.engines.models import smollm2_dir

    model_dir = smollm2_dir()
    tmp = Path(tempfile.mkdtemp(prefix="tt-bench-"))
    db_url = args.db_url or f"sqlite:///{tmp / 'gateway.db'}"
    console.rule(f"[bold]gateway overhead · {args.upstream} upstream · {args.sessions} sessions")
    console.print(machine_line())
    upstream: Any = None
    gateways: dict[str, ServerProcess] = {}
    """By meter: `gateway` (the first count of --gateway-workers), `gateway ×N` for the others, `baseline`."""
    db_urls: dict[str, str] = {}
    profiler: Profiler | None = None
    folded: Path | None = None
    try:
        with console.status("starting the upstream…"):
            upstream = start_upstream(args, model_dir)
        vias: list[Target] = []
        with console.status("starting the gateway…"):
            for i, workers in enumerate(worker_counts):
                meter = "gateway" if i == 0 else f"gateway ×{workers}"
                db_urls[meter] = db_url if i == 0 else f"sqlite:///{tmp / f'gateway-{workers}.db'}"
                gateways[meter] = start_gateway(upstream.url, model_dir, db_urls[meter], gateway_env,
                                                args.gateway_src, workers=workers)
                port = int(gateways[meter].url.rsplit(":", 1)[1])
                suffix = f" ×{workers}" if len(worker_counts) > 1 else ""
                vias += [Target(gateway_name(api) + suffix, "127.0.0.1", port, via_gateway=True, api=APIS[api],
                                meter=meter) for api in apis]
            if args.baseline_src:
                db_urls["baseline"] = f"sqlite:///{tmp / 'baseline.db'}" if db_url.startswith("sqlite") else db_url
                gateways["baseline"] = start_gateway(upstream.url, model_dir, db_urls["baseline"], gateway_env,
                                                     args.baseline_src)
                port = int(gateways["baseline"].url.rsplit(":", 1)[1])
                vias += [Target(f"gateway {api} (baseline)", "127.0.0.1", port, via_gateway=True,
                                api=APIS[api], meter="baseline") for api in apis]
        console.print(f"upstream {upstream.url} · gateways {[g.url for g in gateways.values()]} · store {db_url} · "
                      f"logs in {OUT_DIR}")
        for meter, cpus in pins.items():
            pin(gateways[meter].pid, cpus)
        if args.profile:
            profiler = Profiler(args.py_spy, gateways["gateway"].pid, rate=250)
        meters: dict[str, Callable[[], float]] = {
            meter: functools.partial(group_cpu_seconds, server.pid) for meter, server in gateways.items()
        }
        for part in THREAD_CPU_PARTS:  # where the first gateway's CPU goes: its event loop or other threads
            meters[f"gateway {part}"] = functools.partial(thread_cpu_seconds, gateways["gateway"].pid, part)
        meters["loadgen"] = self_cpu_seconds
        if upstream.process is not None:
            meters["upstream"] = functools.partial(group_cpu_seconds, upstream.process.pid)
        runner = LoadRunner(plan, workload, meters)
        host, upstream_port = upstream.url.removeprefix("http://").rsplit(":", 1)
        direct = Target("direct", host, int(upstream_port), via_gateway=False, api=APIS["chat"])
        started = time.perf_counter()
        results = asyncio.run(runner.run([direct, *vias]))
        elapsed = time.perf_counter() - started
        folded = profiler.stop() if profiler else None
        with console.status("checking the store…"):
            check = check_stores(db_urls, runner.received, None if vllm else args.max_tokens)
    finally:
        for server in gateways.values():
            server.stop()
        if upstream is not None:
            upstream.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    tables = report(results, plan, check, args.upstream, vias)
    if folded is not None and folded.exists():
        tables += profile_tables(folded, top=25)
    for table in tables:
        console.print(table.rich())
    turns = (
        f"{args.turns} requests each" if args.sessions == "multiturn" else "a new session for every request"
    )
    notes = [
        f"sessions: {args.sessions} ({turns}); answers of {args.max_tokens} tokens; user messages of "
        f"{args.prompt_words} words; {plan.rounds} alternating direct/gateway rounds per config; "
        f"load phases took {elapsed:.0f} s",
        "direct = the upstream's own /v1/chat/completions; gateway <api> = /s/<session>/v1/chat/completions, "
        "/v1/responses or /v1/messages with the same conversation in that API's shape (chat template + "
        "tokenizer, upstream /v1/completions with token ids, store commit before answering)",
        f"targets per round: direct + {len(vias)} gateway targets, their order rotated every round",
        "added = gateway percentile minus direct percentile; TTFT = until the first SSE event carrying text",
        "one machine with shared, partly stolen cores: compare within a run, not across runs",
    ]
    if args.gateway_src:
        notes.append(f"gateway source: {args.gateway_src}" + _commit_of(args.gateway_src))
    if args.baseline_src:
        notes.append(f"baseline gateway source: {args.baseline_src}" + _commit_of(args.baseline_src)
                     + "; its own store of the same kind")
    if len(worker_counts) > 1:
        notes.append(f"gateway ×N = `serve --workers N` on its own SQLite store; gateways with "
                     f"{', '.join(map(str, worker_counts))} processes, interleaved with direct in every round")
    if args.upstream == "torch":
        notes.append(f"torch upstream on {args.torch_device}: transformers' continuous batching, greedy, every "
                     "answer max_tokens long" + (", SmolLM2's architecture with random weights"
                                                 if args.torch_random_weights else ""))
    for meter, cpus in pins.items():
        which = "gateway" if meter == "gateway" else "baseline gateway"
        notes.append(f"{which} pinned to CPU {','.join(map(str, sorted(cpus)))} (every thread)")
    if gateway_env:
        notes.append(f"gateway environment: {gateway_env}")
    if folded is not None:
        notes.append(f"py-spy was attached (timings skewed); folded stacks: {folded.relative_to(REPO_ROOT)}")
    name = args.output or "gateway_overhead" + ("" if args.upstream == "fixed" else f"_{args.upstream}") + (
        "_profile" if args.profile else ""
    )
    command = " ".join(["python -m bench.gateway_overhead", *map(shlex.quote, argv or sys.argv[1:])])
    path = write_results(name, "Gateway overhead", command, tables, notes)
    console.print(f"written to {path}")


def _commit_of(src: Path) -> str:
    marker = src / "COMMIT"
    return f" (commit {marker.read_text().strip()[:12]})" if marker.exists() else ""


@dataclass
class ExternalUpstream:
    """An upstream this script did not start (`--upstream-url`): not measured for CPU, not stopped."""

    url: str
    process: None = None

    def stop(self) -> None:
        pass


def start_upstream(args: argparse.Namespace, model_dir: Path) -> Any:
    """A started `VLLMServer` or fixed-upstream `ServerProcess` (both have `.url`, `.process`, `.stop()`),
    or the server at `--upstream-url`."""
    if args.upstream_url:
        return ExternalUpstream(args.upstream_url.rstrip("/").removesuffix("/v1"))
    if args.upstream == "vllm":
        from tracetrain.engines.vllm_server import VLLMServer

        server = VLLMServer(
            model_dir, served_model_name=MODEL_NAME, max_model_len=4096, log_path=OUT_DIR / "vllm.log",
            listen="tcp",  # the direct arm sends HTTP to it by host and port
        )
        return server.start()
    if args.upstream == "torch":
        port = free_port()
        cmd = python_cmd("-m", "bench.torch_upstream", "--model", str(model_dir), "--port", str(port),
                         "--device", args.torch_device, *(["--random-weights"] if args.torch_random_weights else []),
                         *(["--dtype", "float32"] if args.torch_device == "cpu" else []))
        return ServerProcess("torch_upstream", cmd, f"http://127.0.0.1:{port}").start(timeout=300)
    answer = orjson.dumps(fixed_answer(model_dir, args.max_tokens)).decode()
    port = free_port()
    cmd = python_cmd(
        "-m",
        "bench.fixed_upstream",
        "--port",
        str(port),
        "--workers",
        str(args.upstream_workers),
        "--token-delay-ms",
        str(args.token_delay_ms),
        "--answer-json",
        answer,
    )
    return ServerProcess("fixed_upstream", cmd, f"http://127.0.0.1:{port}").start()


if __name__ == "__main__":
    main()
