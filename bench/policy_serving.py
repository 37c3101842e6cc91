"""The `serving` part of `bench.policies`: throughput and latency of N active named policies on one vLLM, and
the other policies' traffic while one publishes (see bench/policies.py)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import (
    Part,
    ResultTable,
    ServerProcess,
    console,
    free_port,
    percentile,
    provenance,
    python_cmd,
    run_started,
)
from tracetrain.engines.models import smollm2_dir
from tracetrain.engines.probe import Probe, probe_token_ids, write_probe

MODEL = "smollm2"
ARMS = (1, 2, 4, 8)
POLICIES = [f"p{i}" for i in range(max(ARMS))]
PUBLISH_POLICIES = 4
"""Policies under load while new versions of them are published, one at a time."""
LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 16
PROMPTS = ("Name one colour.", "Say hello in French.", "What is two plus three?", "Name a fruit.",
           "Give a word that means fast.", "Name a planet.", "Say a number below ten.", "Name an animal.")


def interleaved(arms: Sequence[int], repeats: int) -> list[int]:
    """The arms in `repeats` rounds, every other round reversed (1 2 4 8 8 4 2 1 1 2 …): a drift in the
    machine's load over the run then reaches every arm about alike, not mostly the one that runs last."""
    order: list[int] = []
    for repeat in range(repeats):
        order += list(arms) if repeat % 2 == 0 else list(reversed(arms))
    return order


@dataclass(frozen=True)
class CallRecord:
    policy: str
    start: float
    end: float
    status: int
    """The HTTP status; 0 for a call that got no response."""
    version: int | None
    """`X-Policy-Version` of the reply."""
    tokens: int
    """Streamed chunks with content (vLLM sends a token each)."""
    chunks: tuple[float, ...] = ()
    """When each of them arrived."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def overlapping(calls: Sequence[CallRecord], start: float, end: float) -> list[CallRecord]:
    """Calls in flight at some moment between `start` and `end`."""
    return [c for c in calls if c.start < end and c.end > start]


def within(calls: Sequence[CallRecord], start: float, end: float) -> list[CallRecord]:
    """Calls sent and answered between `start` and `end`."""
    return [c for c in calls if c.start >= start and c.end <= end]


def ms(values: Sequence[float], q: float) -> float:
    return 1000 * percentile(values, q)


class Adapters:
    """LoRA adapters on the served base model, each from its own seed: random A and B (peft starts B at zero, a
    no-op), so every policy's version has weights of its own. Each is saved with the probe a trainer writes
    beside a checkpoint (engines/probe.py), so the gateway's publish checks that vLLM serves it, as it checks a
    trainer's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        base_dir = smollm2_dir()
        self.probe_ids = probe_token_ids(AutoTokenizer.from_pretrained(str(base_dir)))
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=LORA_TARGETS)
        self.model = get_peft_model(base, config)

    def write(self, policy: str, version: int, seed: int) -> Path:
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if "lora_A" in name:
                    torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))
                elif "lora_B" in name:
                    param.normal_(0.0, 0.005)  # distinct outputs, still answers of about the same length
            logits = self.model(torch.tensor([self.probe_ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scored = [float(logprobs[i - 1, self.probe_ids[i]]) for i in range(1, len(self.probe_ids))]
        path = self.root / f"{policy}-v{version}"
        self.model.save_pretrained(str(path))
        write_probe(path, Probe(self.probe_ids, scored, "float32"))
        return path


def start_gateway(workdir: Path, *, probe: bool) -> ServerProcess:
    """`tracetrain serve` starting its own vLLM, with every policy declared and room for all their adapters
    beside the default line's; `probe`: whether a publish scores the adapter's probe (`engine.publish_probe`)."""
    config = workdir / "gateway.yaml"
    engine = {"max_loras": len(POLICIES) + 1, "publish_probe": probe}
    config.write_text(json.dumps({"engine": engine,  # YAML reads JSON
                                  "gateway": {"policies": [{"name": name} for name in POLICIES]}}))
    port = free_port()
    cmd = python_cmd("-m", "tracetrain.cli", "--config", str(config), "serve", "--engine", "vllm",
                     "--served-model-name", MODEL, "--port", str(port),
                     "--db-url", f"sqlite:///{workdir / 'gateway.db'}")
    return ServerProcess("policies-gateway", cmd, f"http://127.0.0.1:{port}").start(timeout=900)


async def publish(client: httpx.AsyncClient, url: str, policy: str, version: int, path: Path) -> None:
    """A policy's new version, as a trainer in another process hands it to the gateway."""
    response = await client.post(f"{url}/v1/policies", json={"version": version, "checkpoint": str(path),
                                                              "kind": "lora", "policy": policy})
    if response.status_code != 200:
        raise RuntimeError(f"publishing {policy} v{version} failed: {response.status_code} {response.text[:300]}")


class Load:
    """Closed-loop clients, each sending one short chat call after another, round-robin over `policies` by
    path (`None`: the default line's plain path). Streamed: the chunks' arrival shows whether a publish holds
    up other calls midway, and a client that goes away gets its call aborted in vLLM (proxy/event_stream.py),
    so a run's leftover calls do not load the next one."""

    def __init__(self, client: httpx.AsyncClient, url: str, policies: Sequence[str | None], concurrency: int) -> None:
        self.client, self.url, self.policies = client, url, list(policies)
        self.records: list[CallRecord] = []
        self._turns = itertools.count()
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._caller()) for _ in range(concurrency)]

    async def _caller(self) -> None:
        while not self._stop.is_set():
            turn = next(self._turns)
            policy = self.policies[turn % len(self.policies)]
            prompt = PROMPTS[(turn // len(self.policies)) % len(PROMPTS)]  # every policy gets every prompt
            path = "/v1/chat/completions" if policy is None else f"/p/{policy}/v1/chat/completions"
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                    "temperature": 1.0, "stream": True}
            started = time.perf_counter()
            try:
                status, version, chunks = await self._call(path, body)
            except httpx.HTTPError:
                status, version, chunks = 0, None, ()
            self.records.append(CallRecord(policy or "default", started, time.perf_counter(), status, version,
                                           len(chunks), chunks))

    async def _call(self, path: str, body: dict[str, Any]) -> tuple[int, int | None, tuple[float, ...]]:
        chunks = []
        async with self.client.stream("POST", self.url + path, json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[len("data: "):]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    chunks.append(time.perf_counter())
        return response.status_code, _version(response), tuple(chunks)

    async def stop(self, *, cancel: bool = False) -> None:
        """No new calls; returns when those in flight are answered, or at once with `cancel` (they are not
        recorded, and the gateway aborts them in vLLM)."""
        self._stop.set()
        if cancel:
            for task in self._tasks:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=cancel)


def _version(response: httpx.Response) -> int | None:
    version = response.headers.get("x-policy-version")
    return int(version) if version is not None else None


async def arm_run(client: httpx.AsyncClient, url: str, n: int, args: argparse.Namespace,
                  seconds: float) -> dict[str, Any]:
    """N active policies (0: the default line, base weights) for `seconds` after `--warmup`; the figures are
    over the calls answered in the measured window."""
    policies: list[str | None] = list(POLICIES[:n]) if n else [None]
    load = Load(client, url, policies, args.concurrency)
    await asyncio.sleep(args.warmup)
    began = time.perf_counter()
    await asyncio.sleep(seconds)
    ended = time.perf_counter()
    await load.stop(cancel=True)  # the calls still running are past the window: not worth their wait
    # Answered in the window, whenever sent: in a closed loop at steady state that is the throughput, and it
    # keeps the calls longer than the window that a sent-and-answered rule would drop.
    ok = [c for c in load.records if began <= c.end <= ended and c.status == 200]
    expected = 1 if n else 0  # every policy serves its first published version; the default line none
    return {"policies": n, "calls": len(ok), "calls_per_s": len(ok) / (ended - began),
            "p50_ms": ms([c.seconds for c in ok], 50), "p95_ms": ms([c.seconds for c in ok], 95),
            "tokens_per_call": statistics.mean(c.tokens for c in ok) if ok else float("nan"),
            "tokens_per_s": sum(c.tokens for c in ok) / (ended - began),
            "failed": sum(1 for c in load.records if c.status != 200),
            "wrong_version": sum(1 for c in ok if c.version != expected)}


@dataclass
class PublishEvent:
    policy: str
    version: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class PublishWindow:
    """One publish seen from the load: the other policies' calls and streamed tokens in the window before it
    and while it was in progress, and the published policy's calls after it."""

    policy: str
    version: int
    publish_s: float
    before_s: float
    """The window before: from the previous publish's end, `lookback` seconds at most."""
    before_ms: list[float] = field(default_factory=list)
    """Other policies' calls answered in the window before."""
    during_ms: list[float] = field(default_factory=list)
    """Other policies' calls in flight at some moment of the publish."""
    answered_during: int = 0
    """Other policies' calls answered while the publish was in progress."""
    tokens_per_s_before: float = 0.0
    tokens_per_s_during: float = 0.0
    """Other policies' streamed tokens arriving per second, in the window before and during the publish."""
    gap_ms_before: float = 0.0
    gap_ms_during: float = 0.0
    """The longest wait for another policy's next token: within the window before, and overlapping the publish
    (a publish that held up other calls shows here as a wait about as long as itself)."""
    next_version: int | None = None
    """`X-Policy-Version` of the published policy's first call sent after the publish returned."""
    old_after: int = 0
    """The published policy's calls sent after the publish returned that report an older version (must be 0; a
    later publish of the same policy serves a newer one)."""


def _gaps(calls: Sequence[CallRecord]) -> list[tuple[float, float]]:
    """Each wait between two consecutive tokens of one call: (first arrival, next arrival)."""
    return [(a, b) for c in calls for a, b in itertools.pairwise(c.chunks)]


def windows(records: Sequence[CallRecord], events: Sequence[PublishEvent], lookback: float) -> list[PublishWindow]:
    result = []
    previous_end = -math.inf
    for event in events:
        others = [c for c in records if c.policy != event.policy and c.status == 200]
        begin = max(previous_end, event.start - lookback)
        chunks = [t for c in others for t in c.chunks]
        gaps = _gaps(others)
        after = sorted((c for c in records if c.policy == event.policy and c.status == 200 and c.start >= event.end),
                       key=lambda c: c.start)
        during = overlapping(others, event.start, event.end)
        result.append(PublishWindow(
            event.policy, event.version, event.seconds, event.start - begin,
            before_ms=[1000 * c.seconds for c in others if begin <= c.end <= event.start],
            during_ms=[1000 * c.seconds for c in during],
            answered_during=sum(1 for c in during if c.end <= event.end),
            tokens_per_s_before=sum(1 for t in chunks if begin <= t < event.start) / max(event.start - begin, 1e-9),
            tokens_per_s_during=sum(1 for t in chunks if event.start <= t < event.end) / max(event.seconds, 1e-9),
            gap_ms_before=1000 * max((b - a for a, b in gaps if a >= begin and b <= event.start), default=0.0),
            gap_ms_during=1000 * max((b - a for a, b in gaps if a < event.end and b > event.start), default=0.0),
            next_version=after[0].version if after else None,
            old_after=sum(1 for c in after if c.version is None or c.version < event.version)))
        previous_end = event.end
    return result


async def publishes_under_load(client: httpx.AsyncClient, url: str, planned: Sequence[tuple[str, int, Path]],
                               args: argparse.Namespace) -> tuple[list[PublishWindow], int]:
    """Each planned version published after `--publish-gap` seconds of load over the first four policies:
    the windows, and the calls that failed."""
    load = Load(client, url, POLICIES[:PUBLISH_POLICIES], args.concurrency)
    events = []
    try:
        await asyncio.sleep(args.warmup)
        for policy, version, path in planned:
            await asyncio.sleep(args.publish_gap)
            began = time.perf_counter()
            await publish(client, url, policy, version, path)
            events.append(PublishEvent(policy, version, began, time.perf_counter()))
            console.log(f"published {policy} v{version} in {events[-1].seconds:.2f} s under load")
        await asyncio.sleep(args.publish_gap)
    finally:
        await load.stop()  # the calls in flight answered: the last publish's policy has its next call
    return windows(load.records, events, args.publish_gap), sum(1 for c in load.records if c.status != 200)


async def serve_and_measure(url: str, first: Mapping[str, Path], planned: Sequence[tuple[str, int, Path]],
                            args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=300) as client:
        for policy, path in first.items():
            await publish(client, url, policy, 1, path)
        console.log(f"published version 1 of {len(first)} policies")
        warm = Load(client, url, POLICIES, args.concurrency)  # every adapter used once before the clock starts
        await asyncio.sleep(max(args.warmup, 5.0))
        await warm.stop()
        order = interleaved(args.arms, args.repeats)
        runs = []
        for i, n in enumerate(order):
            run = await arm_run(client, url, n, args, seconds)
            runs.append(run)
            console.log(f"[{i + 1}/{len(order)}] {n} active {'policy' if n == 1 else 'policies'}: "
                        f"{run['calls_per_s']:.2f} calls/s, p50 {run['p50_ms']:.0f} ms, p95 {run['p95_ms']:.0f} ms"
                        f", {run['failed']} failed")
        console.rule(f"serving: {len(planned)} publishes under load over {PUBLISH_POLICIES} policies")
        published, failed = await publishes_under_load(client, url, planned, args)
    return {"order": order, "runs": runs, "publishes": [asdict(w) for w in published], "publish_failed_calls": failed,
            "windows": published}


def spread(values: Sequence[float], fmt: str) -> str:
    """Mean (min-max) over the repeats."""
    return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def serving_part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    seconds = args.seconds or 25.0
    root = Path(tempfile.mkdtemp(prefix="bench-policies-"))
    try:
        console.rule(f"serving: adapters for {len(POLICIES)} policies and {args.publishes} publishes")
        adapters = Adapters(root)
        first = {name: adapters.write(name, 1, seed=1000 + i) for i, name in enumerate(POLICIES)}
        planned = []
        for k in range(args.publishes):  # round-robin over the loaded policies, each its next version
            policy, version = POLICIES[k % PUBLISH_POLICIES], 2 + k // PUBLISH_POLICIES
            planned.append((policy, version, adapters.write(policy, version, seed=1000 * version + k)))
        del adapters
        console.rule("serving: starting the gateway and its vLLM")
        gateway = start_gateway(root, probe=args.probe)
        console.log(f"gateway up (log: {gateway.log_path})")
        try:
            measured = asyncio.run(serve_and_measure(gateway.url, first, planned, args, seconds))
        finally:
            gateway.stop(grace=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tables, notes = serving_report(measured, args, seconds)
    return Part("serving", command, provenance(started), tables, notes, measured)


def _next_version(window: PublishWindow) -> str:
    if window.next_version is None:
        return "no call after"
    return f"v{window.next_version}" + ("" if window.next_version == window.version and not window.old_after
                                        else f" ({window.old_after} old after)")


def serving_report(measured: dict[str, Any], args: argparse.Namespace,
                   seconds: float) -> tuple[list[ResultTable], list[str]]:
    scaling = ResultTable(f"Serving: active policies on one vLLM, {args.concurrency} closed-loop clients, "
                          f"{MAX_TOKENS}-token chat calls, {seconds:g} s per run; mean (min-max) over runs",
                          ["active policies", "runs", "calls/s", "tokens/s", "p50 ms", "p95 ms", "tokens/call",
                           "failed", "wrong version"])
    for n in args.arms:
        rows = [r for r in measured["runs"] if r["policies"] == n]
        scaling.add(f"{n}" if n else "0 (default line, no adapter)", len(rows),
                    spread([r["calls_per_s"] for r in rows], ".2f"), spread([r["tokens_per_s"] for r in rows], ".1f"),
                    spread([r["p50_ms"] for r in rows], ".0f"),
                    spread([r["p95_ms"] for r in rows], ".0f"),
                    f"{statistics.mean(r['tokens_per_call'] for r in rows):.1f}",
                    sum(r["failed"] for r in rows), sum(r["wrong_version"] for r in rows))
    published: list[PublishWindow] = measured.pop("windows")
    during = ResultTable(f"Serving: a new version of one policy published while {PUBLISH_POLICIES} are under load; "
                         "the other policies' traffic in the window before each publish and during it",
                         ["publish", "publish s", "tokens/s before", "tokens/s during", "longest token wait ms "
                          "before", "longest token wait ms during", "calls answered before", "p50 ms before",
                          "calls in flight during", "p50 ms during", "answered during", "next call's version"])

    def row(label: str, ws: Sequence[PublishWindow], publish_s: str) -> None:
        before = [x for w in ws for x in w.before_ms]
        inflight = [x for w in ws for x in w.during_ms]
        new = sum(1 for w in ws if w.next_version == w.version and not w.old_after)
        during.add(label, publish_s,
                   f"{sum(w.tokens_per_s_before * w.before_s for w in ws) / sum(w.before_s for w in ws):.1f}",
                   f"{sum(w.tokens_per_s_during * w.publish_s for w in ws) / sum(w.publish_s for w in ws):.1f}",
                   f"{max(w.gap_ms_before for w in ws):.0f}", f"{max(w.gap_ms_during for w in ws):.0f}",
                   len(before), f"{percentile(before, 50):.0f}", len(inflight), f"{percentile(inflight, 50):.0f}",
                   sum(w.answered_during for w in ws),
                   _next_version(ws[0]) if len(ws) == 1 else f"{new} of {len(ws)} new")

    for w in published:
        row(f"{w.policy} v{w.version}", [w], f"{w.publish_s:.2f}")
    if published:
        row("all", published, f"{percentile([w.publish_s for w in published], 50):.2f} p50")
    notes = [
        f"Serving: one `tracetrain serve` starting one vLLM (CPU) with SmolLM2-135M-Instruct, LoRA enabled, "
        f"engine.max_loras {len(POLICIES) + 1}; {len(POLICIES)} named policies declared in gateway.policies, each "
        f"published a rank-{LORA_RANK} adapter of its own (random A and B from a fixed seed, every linear layer) "
        "through POST /v1/policies; calls go through /p/{policy}/v1/chat/completions and are "
        "recorded in the gateway's SQLite store as any call is.",
        f"Serving, load: {args.concurrency} clients each send a chat call ({MAX_TOKENS} sampled tokens at most, "
        f"temperature 1, one of {len(PROMPTS)} fixed short prompts) as soon as the previous is answered, "
        "round-robin over the active policies, streamed; per run, the calls answered in the measured window, "
        f"after {args.warmup:g} s of warm-up (the calls still running at its end are abandoned). "
        f"Runs in the order {' '.join(map(str, measured['order']))}. "
        "wrong version: calls whose X-Policy-Version was not the policy's published version (must be 0).",
        f"Serving, publishes: load over {PUBLISH_POLICIES} policies, a new version published every "
        f"{args.publish_gap:g} s (round-robin over them). publish s: the POST /v1/policies call (the gateway "
        "checks the adapter, vLLM loads it, the policy switches to it and its previous adapter is unloaded"
        + ("; the probe is scored on it" if args.probe else "") + "). The other policies' traffic: before is the "
        "window after the previous publish and before this one; tokens/s: their streamed tokens arriving per "
        "second; longest token wait: the longest wait for one of their calls' next token (a publish that paused "
        "them would show here about as long as itself); calls answered before and their p50; calls in flight "
        "at some moment of the publish and their p50; answered during: those answered while it was in progress. "
        "next call's version: X-Policy-Version of the published policy's first call sent after the publish "
        "returned (every later one must report it too). all: publishes pooled, rates weighted by time.",
        f"Calls that failed during the publishes: {measured['publish_failed_calls']} (must be 0).",
        "Measured on a machine shared with other engineers' CPU-heavy work (its load average at the start and end "
        "is in the provenance line); the arms are interleaved so that it weighs on all of them, and nothing else "
        "was done against the noise.",
    ]
    return [scaling, during], notes


