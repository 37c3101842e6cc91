"""Soak and the canary's sequential test, in two parts: `soak`, a long run of mixed agent load on one gateway
in front of vLLM (CPU), with a new LoRA version published every minute under canary promotion, some of them
deliberately broken; `simulated`, the same sequential test (tracetrain/proxy/sequential.py) on simulated
rewards, no servers: its operating characteristics, at the settings the soak's gateway uses.

    python -m bench.soak --minutes 30                # both parts
    python -m bench.soak --parts simulated           # the simulated test alone (formerly bench.canary_test)

`soak` watches, every `--sample-s` seconds: the gateway's resident memory, open file descriptors and
threads, vLLM's memory, and per window of `--window-s` seconds the calls answered and failed and their
p50 / p99 latency. At the end: every answered call's id looked up in the store (lost = answered but not
stored, must be 0), and each version's canary decision with its numbers. Agents: `--agents` concurrent
loops, each session one or two turns, the API rotating over Chat Completions, Responses and Messages,
streamed and not, with a one-digit sum to answer; the reward is 1 when the answer holds the right number
(posted as the session's final reward). Versions: LoRA adapters built here on SmolLM2 (rank 8): most are
small random perturbations ("sound"), every `--broken-every`-th has its weights scaled up until the model
writes garbage ("broken"). The metric and the pass lines (lost 0, broken versions rolled back, no sound one
rolled back is reported as is) are fixed here before the run.

`simulated`: how often a canary better than, equal to or worse than the incumbent is promoted or rolled
back, and after how many of its sessions. Each new session goes to the canary with probability
`canary_share`, its final reward is Bernoulli (the incumbent's success rate `--base`, the canary's `--base
+ delta`); the test runs after every `--look-every` new rewards, as the gateway runs it every second. Fixed
before the run: a rollback of a canary that is not worse by more than the margin is an error, and so is a
promotion of one worse by more than the margin; the pass line for the first is `promotion.alpha`.

Both parts use the gateway's default promotion settings unless `--share`, `--min-sessions`,
`--max-sessions` or `--margin` override them, and the results say which.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench.common import (
    OUT_DIR,
    Part,
    ResultTable,
    RunStart,
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
from bench.gateway_overhead.apis import APIS
from bench.gateway_overhead.client import Connection, HTTPFailure
from tracetrain.config import PromotionConfig
from tracetrain.proxy.sequential import decide

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a calculator. Reply with the number only."


@dataclass
class CallRecord:
    t: float
    api: str
    stream: bool
    status: int
    latency_s: float


@dataclass
class Soak:
    started: float = field(default_factory=time.monotonic)
    calls: list[CallRecord] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    samples: list[dict[str, float]] = field(default_factory=list)
    publishes: list[dict[str, Any]] = field(default_factory=list)
    rewards_failed: int = 0

    def now(self) -> float:
        return time.monotonic() - self.started


# --- versions --------------------------------------------------------------------------------------------

def build_adapters(model_dir: Path, out: Path, count: int, broken_every: int) -> list[tuple[Path, bool]]:
    """`count` PEFT LoRA adapters (rank 8, all linear layers): (directory, broken)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = []
    for version in range(1, count + 1):
        broken = version % broken_every == 0
        target = out / f"v{version}"
        adapters.append((target, broken))
        if (target / "adapter_config.json").exists():
            continue
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name or "lora_A" in name:
                    scale = 0.5 if broken else 0.01
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(str(target))
    return adapters


# --- load ------------------------------------------------------------------------------------------------

async def agent(host: str, port: int, n: int, soak: Soak, stop: asyncio.Event, rewards: httpx.AsyncClient) -> None:
    rng = random.Random(n)
    connection = Connection(host, port)
    apis = list(APIS.values())
    k = 0
    while not stop.is_set():
        api, stream = apis[k % 3], (k // 3) % 2 == 1
        session = f"soak-{n}-{k}"
        k += 1
        a, b = rng.randint(1, 9), rng.randint(0, 9)
        turns = [("user", f"What is {a} + {b}?")]
        reward = 0.0
        for _turn in range(1 + (k % 4 == 0)):
            body = api.body(SYSTEM, turns, 8, stream, 0.7)
            body["model"] = MODEL
            started = soak.now()
            try:
                reply = await connection.post(f"/s/{session}{api.path}", body, stream=stream)
            except HTTPFailure:
                soak.calls.append(CallRecord(started, api.name, stream, 0, soak.now() - started))
                await connection.close()
                break
            if reply.status == 200:
                try:
                    completion_id, answer, _ = api.parse(reply, stream)
                except (HTTPFailure, KeyError, ValueError):
                    soak.calls.append(CallRecord(started, api.name, stream, 599, reply.latency_s))
                    break
                soak.answered.add(completion_id)
                reward = float(str(a + b) in answer)
                turns += [("assistant", answer or "?"), ("user", "Are you sure? Say the number again.")]
            soak.calls.append(CallRecord(started, api.name, stream, reply.status, reply.latency_s))
            if reply.status != 200:
                break
        else:
            try:
                posted = await rewards.post("/v1/rewards", json={"session_id": session, "reward": reward,
                                                                  "final": True})
                soak.rewards_failed += posted.status_code != 200
            except httpx.HTTPError:
                soak.rewards_failed += 1
    await connection.close()


async def publisher(url: str, adapters: list[tuple[Path, bool]], soak: Soak, stop: asyncio.Event,
                    every_s: float) -> None:
    pending = list(enumerate(adapters, start=1))
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while pending and not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=every_s)
                return
            except TimeoutError:
                pass
            version, (path, broken) = pending[0]
            started = time.perf_counter()
            response = await client.post("/v1/policies", json={"version": version, "checkpoint": str(path),
                                                                "kind": "lora"})
            entry = {"t": soak.now(), "version": version, "broken": broken, "status": response.status_code,
                     "seconds": time.perf_counter() - started}
            if response.status_code != 200:
                entry["error"] = response.json().get("error", {}).get("code")
            soak.publishes.append(entry)
            if response.status_code == 200:
                pending.pop(0)
            console.log(f"publish v{version} ({'broken' if broken else 'sound'}): {response.status_code} "
                        f"{entry.get('error') or ''}")


def sampler(pid: int, soak: Soak, stop: threading.Event, every_s: float) -> None:
    import psutil

    gateway = psutil.Process(pid)
    while not stop.wait(every_s):
        try:
            children = gateway.children(recursive=True)
            engine_rss = sum(c.memory_info().rss for c in children if "vllm" in " ".join(c.cmdline()).lower())
            soak.samples.append({"t": soak.now(), "rss_mb": gateway.memory_info().rss / 2**20,
                                 "fds": gateway.num_fds(), "threads": gateway.num_threads(),
                                 "engine_rss_mb": engine_rss / 2**20})
        except psutil.Error:
            continue
        calls = [c for c in soak.calls if c.t >= soak.now() - every_s]
        lat = [c.latency_s for c in calls if c.status == 200]
        console.log(f"{soak.now() / 60:5.1f} min: {len(calls) / every_s:.1f} calls/s, p99 "
                    f"{percentile(lat, 99):.2f} s, gateway RSS {soak.samples[-1]['rss_mb']:.0f} MB, "
                    f"fds {soak.samples[-1]['fds']:.0f}")


# --- report ----------------------------------------------------------------------------------------------

def stored_ids(db_url: str) -> set[str]:
    from tracetrain.store.db import connect_db

    with connect_db(db_url).connect() as conn:
        return {row[0] for row in conn.execute(text("SELECT completion_id FROM calls")).all()}


def plot(soak: Soak, window_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ends = [w * window_s for w in range(1, int(max(c.t for c in soak.calls) // window_s) + 2)]
    p99 = [percentile([c.latency_s for c in soak.calls if e - window_s <= c.t < e and c.status == 200], 99)
           for e in ends]
    p50 = [percentile([c.latency_s for c in soak.calls if e - window_s <= c.t < e and c.status == 200], 50)
           for e in ends]
    minutes = [e / 60 for e in ends]
    ax1.plot(minutes, p99, label="p99")
    ax1.plot(minutes, p50, label="p50")
    for entry in soak.publishes:
        if entry["status"] == 200:
            ax1.axvline(entry["t"] / 60, color="red" if entry["broken"] else "grey", alpha=0.3, lw=1)
    ax1.set_ylabel("latency (s)")
    ax1.legend(loc="upper left")
    ax1.set_title("Soak: latency per window (lines: publishes, red = broken version)")
    ts = [s["t"] / 60 for s in soak.samples]
    ax2.plot(ts, [s["rss_mb"] for s in soak.samples], label="gateway RSS")
    ax2.set_ylabel("MB")
    ax2.legend(loc="upper left")
    ax3.plot(ts, [s["fds"] for s in soak.samples], label="open fds")
    ax3.plot(ts, [s["threads"] for s in soak.samples], label="threads")
    ax3.set_xlabel("minutes")
    ax3.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(soak: Soak, policies: dict[str, Any], db_url: str, args: argparse.Namespace, command: str,
           started: RunStart) -> Part:
    stored = stored_ids(db_url)
    lost = soak.answered - stored
    windows = ResultTable(f"Per {args.window_s / 60:g}-minute window",
                          ["minutes", "calls", "failed (5xx / transport)", "429", "p50 s", "p99 s",
                           "gateway RSS MB", "open fds", "threads"])
    end = max(c.t for c in soak.calls)
    w = 0.0
    while w < end:
        calls = [c for c in soak.calls if w <= c.t < w + args.window_s]
        ok = [c.latency_s for c in calls if c.status == 200]
        samples = [s for s in soak.samples if w <= s["t"] < w + args.window_s] or soak.samples[-1:]
        windows.add(f"{w / 60:.0f}–{(w + args.window_s) / 60:.0f}", len(calls),
                    sum(c.status >= 500 or c.status == 0 for c in calls), sum(c.status == 429 for c in calls),
                    f"{percentile(ok, 50):.2f}", f"{percentile(ok, 99):.2f}", f"{samples[-1]['rss_mb']:.0f}",
                    f"{samples[-1]['fds']:.0f}", f"{samples[-1]['threads']:.0f}")
        w += args.window_s
    total = ResultTable("Whole run", ["calls", "answered", "failed", "other 4xx", "answered ids stored",
                                      "lost (answered, not stored)", "reward posts failed"])
    total.add(len(soak.calls), len(soak.answered), sum(c.status >= 500 or c.status == 0 for c in soak.calls),
              sum(400 <= c.status < 500 for c in soak.calls), len(soak.answered & stored), len(lost),
              soak.rewards_failed)
    decisions = ResultTable("Versions published (one a minute when no canary is on trial)",
                            ["version", "kind", "published at min", "decision", "by", "canary n", "incumbent n",
                             "canary mean", "incumbent mean", "interval", "reason"])
    published = {e["version"]: e for e in soak.publishes if e["status"] == 200}
    for row in policies["data"]:
        entry = published.get(row["version"])
        if entry is None:
            continue
        d = row.get("decision") or {}
        interval = d.get("interval")
        decisions.add(row["version"], "broken" if entry["broken"] else "sound", f"{entry['t'] / 60:.1f}",
                      row["promotion"], d.get("by", ""), d.get("canary_n", ""), d.get("incumbent_n", ""),
                      _f(d.get("canary_mean")), _f(d.get("incumbent_mean")),
                      f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "", d.get("reason", ""))
    refused = sum(e["status"] != 200 for e in soak.publishes)
    broken = [r for r in policies["data"] if published.get(r["version"], {}).get("broken")]
    sound = [r for r in policies["data"] if r["version"] in published and not published[r["version"]]["broken"]]
    reasons = [(r.get("decision") or {}).get("reason", "") for r in broken + sound if r["promotion"] != "canary"]
    by_cap = sum(reason.startswith("undecided at") for reason in reasons)
    by_interval = len(reasons) - by_cap
    rss = [s["rss_mb"] for s in soak.samples]
    fds = [s["fds"] for s in soak.samples]
    notes = [
        f"{args.minutes:g} minutes, {args.agents} agents, canary share {args.share}, min {args.min_sessions} / max "
        f"{args.max_sessions} rewarded sessions per arm, margin {args.margin}; SQLite store; vLLM CPU, SmolLM2-135M.",
        ("Promotion settings: the defaults a user gets (PromotionConfig), none overridden." if not
         args.promotion_overrides else "Promotion settings NOT the defaults: " + ", ".join(
             f"promotion.{k}={v}" for k, v in args.promotion_overrides.items()) + "."),
        f"Lost calls: {len(lost)} of {len(soak.answered)} answered (pass line: 0).",
        f"Broken versions rolled back: {sum(r['promotion'] == 'rolled_back' for r in broken)} of {len(broken)}; "
        f"sound versions promoted: {sum(r['promotion'] == 'promoted' for r in sound)} of {len(sound)} "
        f"(still on trial at the end: {sum(r['promotion'] == 'canary' for r in broken + sound)}).",
        f"Decided by the sequential test's interval: {by_interval}; by the cap's mean rule (undecided at "
        f"{args.max_sessions} canary sessions): {by_cap}.",
        f"Publishes refused because a canary was still on trial: {refused} (retried the next minute).",
        f"Gateway RSS first / last / max: {rss[0]:.0f} / {rss[-1]:.0f} / {max(rss):.0f} MB; open fds first / last / "
        f"max: {fds[0]:.0f} / {fds[-1]:.0f} / {max(fds):.0f}." if rss else "no samples",
        "Plot: `soak.png`.",
    ]
    raw = {"arguments": vars(args), "publishes": soak.publishes, "samples": soak.samples, "policies": policies,
           "lost": sorted(lost), "calls": [[round(c.t, 3), c.status, round(c.latency_s, 4)] for c in soak.calls]}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    plot(soak, args.window_s, args.results_dir / "soak.png")
    for table in (total, windows, decisions):
        console.print(table.rich())
    return Part("soak", command, provenance(started), [total, windows, decisions], notes, raw)


def _f(value: Any) -> str:
    return "" if value is None else f"{value:.3f}"


# --- part `simulated`: the sequential test on simulated rewards ------------------------------------------

def run_once(rng: random.Random, p_canary: float, p_incumbent: float, cfg: PromotionConfig, look_every: int,
             max_total: int) -> tuple[str, int]:
    canary: list[float] = []
    incumbent: list[float] = []
    for n in range(1, max_total + 1):
        if rng.random() < cfg.canary_share:
            canary.append(float(rng.random() < p_canary))
        else:
            incumbent.append(float(rng.random() < p_incumbent))
        if n % look_every == 0:
            result = decide(canary, incumbent, margin=cfg.margin, alpha=cfg.alpha,
                            min_sessions=cfg.min_sessions, max_sessions=cfg.max_sessions)
            if result.outcome != "wait":
                return result.outcome, len(canary)
    return "wait", len(canary)


def simulated_part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    cfg = PromotionConfig(**args.promotion_overrides)
    rows: list[dict[str, object]] = []
    rng = random.Random(args.seed)
    table = ResultTable(
        f"Bernoulli rewards, incumbent {args.base}; share {cfg.canary_share}, min {cfg.min_sessions}, max "
        f"{cfg.max_sessions} canary sessions, margin {cfg.margin}, alpha {cfg.alpha}; "
        f"{args.runs} runs per row",
        ["canary − incumbent", "promoted", "rolled back", "undecided", "canary sessions to decide (median)",
         "decided before the cap", "errors"])
    max_total = int(cfg.max_sessions / cfg.canary_share * 2)
    deltas = (0.1, 0.05, 0.0, -0.05, -0.1, -0.2, -0.5)
    for k, delta in enumerate(deltas, start=1):
        t0 = time.perf_counter()
        outcomes = [run_once(rng, min(1.0, max(0.0, args.base + delta)), args.base, cfg, args.look_every, max_total)
                    for _ in range(args.runs)]
        promoted = sum(o == "promote" for o, _ in outcomes)
        rolled = sum(o == "rollback" for o, _ in outcomes)
        early = sum(o != "wait" and n < cfg.max_sessions for o, n in outcomes)
        wrong = rolled if delta > -cfg.margin else promoted if delta < -cfg.margin else None
        rows.append({"delta": delta, "promoted": promoted, "rolled_back": rolled, "decided_before_cap": early,
                     "errors": wrong, "canary_sessions": [n for _, n in outcomes]})
        table.add(f"{delta:+.2f}", f"{promoted / args.runs:.1%}", f"{rolled / args.runs:.1%}",
                  f"{(args.runs - promoted - rolled) / args.runs:.1%}",
                  f"{statistics.median(n for _, n in outcomes):.0f}", f"{early / args.runs:.1%}",
                  "–" if wrong is None else f"{wrong / args.runs:.1%}")
        console.log(f"difference {delta:+.2f} ({k}/{len(deltas)}): {args.runs} runs, "
                    f"{args.runs / (time.perf_counter() - t0):.1f} runs/s")
    console.print(table.rich())
    notes = [
        ("Promotion settings: the defaults a user gets (PromotionConfig), none overridden." if not
         args.promotion_overrides else "Promotion settings NOT the defaults: " + ", ".join(
             f"promotion.{k}={v}" for k, v in args.promotion_overrides.items()) + "."),
        "A difference of exactly −margin is the boundary: neither decision is an error there.",
        "The always-valid interval (mSPRT) keeps wrong rollbacks and promotions to at most alpha while it decides "
        "before the cap; at the cap the mean difference decides, which is where most of the errors come from "
        "when the difference is within about one standard error of the margin.",
        "Where it loses: with Bernoulli rewards and a 0.05 margin, 200 canary sessions rarely separate the arms "
        "by the interval (see 'decided before the cap'); the cap's mean rule then decides. A broken version "
        "(−0.2 or worse) is rolled back long before the cap.",
    ]
    settings = {"share": cfg.canary_share, "min_sessions": cfg.min_sessions,
                "max_sessions": cfg.max_sessions, "margin": cfg.margin, "alpha": cfg.alpha}
    raw = {"runs": args.runs, "base": args.base, "look_every": args.look_every, "seed": args.seed,
           "canary_settings": settings, "rows": rows}
    return Part("simulated", command, provenance(started), [table], notes, raw)


# --- part `soak` ----------------------------------------------------------------------------------------------

def soak_part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    from tracetrain.engines.models import smollm2_dir

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    versions = int(args.minutes * 60 // args.publish_every_s) + 1
    adapters = build_adapters(smollm2_dir(), OUT_DIR / "soak-adapters", versions, args.broken_every)
    port = free_port()
    db = OUT_DIR / f"soak-{port}.db"
    db_url = f"sqlite:///{db}"
    cmd = python_cmd("-m", "tracetrain.cli", "serve", "--engine", "vllm", "--served-model-name", MODEL,
                     "--port", str(port), "--db-url", db_url, "--set", "promotion.mode=canary",
                     "--set", "train.publish=lora", "--set", "gateway.log_level=WARNING",
                     *(arg for name, value in args.promotion_overrides.items()
                       for arg in ("--set", f"promotion.{name}={value}")))
    server = ServerProcess("soak-gateway", cmd, f"http://127.0.0.1:{port}").start(timeout=900)
    soak = Soak()
    stop_sampling = threading.Event()
    threading.Thread(target=sampler, args=(server.pid, soak, stop_sampling, args.sample_s), daemon=True).start()

    async def run() -> None:
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as rewards:
            tasks = [asyncio.create_task(agent("127.0.0.1", port, n, soak, stop, rewards))
                     for n in range(args.agents)]
            tasks.append(asyncio.create_task(publisher(server.url, adapters, soak, stop, args.publish_every_s)))
            await asyncio.sleep(args.minutes * 60)
            stop.set()
            await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
        stop_sampling.set()
        policies = httpx.get(f"{server.url}/v1/policies", timeout=30).json()
    finally:
        server.stop()
    return report(soak, policies, db_url, args, command, started)


PARTS = {"simulated": "the canary's sequential test on simulated rewards (formerly `bench.canary_test`)",
         "soak": "mixed agent load, a publish a minute, canary decisions"}


def main(argv: list[str] | None = None) -> None:
    parser = parts_parser("bench.soak", __doc__, PARTS)
    # None: the gateway's own default (PromotionConfig), which is what a user gets and what both parts report
    parser.add_argument("--share", type=float, default=None, help="promotion.canary_share (default: the config's)")
    parser.add_argument("--min-sessions", type=int, default=None, help="promotion.min_sessions (default: the config's)")
    parser.add_argument("--max-sessions", type=int, default=None, help="promotion.max_sessions (default: the config's)")
    parser.add_argument("--margin", type=float, default=None, help="promotion.margin (default: the config's)")
    load = parser.add_argument_group("part soak")
    load.add_argument("--minutes", type=float, default=30.0)
    load.add_argument("--agents", type=int, default=8)
    load.add_argument("--publish-every-s", type=float, default=60.0)
    load.add_argument("--broken-every", type=int, default=3)
    load.add_argument("--sample-s", type=float, default=10.0)
    load.add_argument("--window-s", type=float, default=180.0)
    simulated = parser.add_argument_group("part simulated")
    simulated.add_argument("--runs", type=int, default=400, help="simulated canaries per difference (default 400)")
    simulated.add_argument("--base", type=float, default=0.5, help="the incumbent's success rate (default 0.5)")
    simulated.add_argument("--look-every", type=int, default=5, help="new rewards between tests (default 5)")
    simulated.add_argument("--seed", type=int, default=0)
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    defaults = PromotionConfig()
    overridden = {name: value for name, value in (("canary_share", args.share), ("min_sessions", args.min_sessions),
                                                  ("max_sessions", args.max_sessions), ("margin", args.margin))
                  if value is not None}
    args.share = overridden.get("canary_share", defaults.canary_share)
    args.min_sessions = overridden.get("min_sessions", defaults.min_sessions)
    args.max_sessions = overridden.get("max_sessions", defaults.max_sessions)
    args.margin = overridden.get("margin", defaults.margin)
    args.promotion_overrides = overridden
    run_parts("soak", "Soak and the canary's sequential test", PARTS,
              {"simulated": simulated_part, "soak": soak_part}, args, command_line("bench.soak", argv))

if __name__ == "__main__":
    main()
