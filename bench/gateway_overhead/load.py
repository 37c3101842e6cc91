"""The load generator: targets, timed phases of requests over keep-alive connections, and rounds whose
target order rotates, with each target's latencies and the CPU every process spent on its phases."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.common import console, percentile
from bench.gateway_overhead.apis import Api
from bench.gateway_overhead.client import Connection, HTTPFailure
from bench.gateway_overhead.workload import Conversation, Workload


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

    def record(self) -> dict[str, Any]:
        """The figures behind the report's rows, for the results' JSON."""
        return {"requests": len(self.samples), "wall_s": round(self.wall_s, 3), "rps": round(self.rps, 2),
                "latency_ms": {f"p{q}": round(self.latency_ms(q), 3) for q in (50, 90, 99)},
                "ttft_ms": {f"p{q}": round(self.ttft_ms(q), 3) for q in (50, 99)},
                "tokens_per_request": round(self.tokens_per_request(), 2),
                "cpu_ms_per_request": {p: round(self.cpu_ms_per_request(p), 4) for p in self.cpu_s},
                "phase_cpu_ms_per_request": {p: [round(v, 4) for v in values]
                                             for p, values in self.phase_cpu_ms.items()},
                "errors": dict(self.errors)}


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

