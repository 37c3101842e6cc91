"""The `scheduler` part of `bench.policies`: which named policy the one trainer steps next when one gets 10×
the traffic of another (see bench/policies.py)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlmodel import Session

from bench.common import (
    Part,
    ResultTable,
    console,
    provenance,
    run_started,
)
from tracetrain.config import TrainConfig
from tracetrain.engines.models import tiny_model_dir
from tracetrain.store import policy_lines
from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Call, Reward
from tracetrain.trainer.batch import Batch
from tracetrain.trainer.loop import Line, Trainer
from tracetrain.trainer.scheduler import Demand, FairScheduler

BATCH = 4

class GreedyScheduler(FairScheduler):
    """For contrast: the due line with the most ready sessions first."""

    def due(self, demands: Mapping[str, Demand], now: float) -> list[str]:
        due = super().due(demands, now)
        return sorted(due, key=lambda name: -demands[name].ready)


def _feed(db_url: str, rates: dict[str, float], stop: threading.Event, ready_at: dict[str, float]) -> None:
    """Finished, rewarded two-session groups of each policy at `rates` sessions per second, in real time."""
    db = open_db(db_url)
    due = {name: time.monotonic() for name in rates}
    counter = 0
    while not stop.is_set():
        now = time.monotonic()
        with Session(db) as s:
            for name, rate in rates.items():
                while due[name] <= now:
                    group = f"{name}-g{counter}"
                    for i, reward in enumerate((0.0, 1.0)):
                        sid = f"{group}-{i}"
                        s.add(AgentSession(id=sid, group_id=group, status="final", policy_version=0, reward=reward,
                                           policy=name))
                        s.add(Call(id=f"{sid}-c", completion_id=f"chatcmpl-{sid}", session_id=sid, group_id=group,
                                   link="start", model="tiny", policy_version=0, state_hash=sid,
                                   prompt_ids=encode_ids([1, 4093, 198, 6004, 2]),
                                   completion_ids=encode_ids([28, 29, 2]),
                                   completion_logprobs=encode_floats([-10.8] * 3), messages=[], response_message={}))
                        s.add(Reward(session_id=sid, value=reward, final=True))
                        ready_at[sid] = now
                    counter += 1
                    due[name] += 2 / rate
            s.commit()
        stop.wait(0.05)


def run_scheduler(scheduler: FairScheduler, seconds: float, rates: dict[str, float],
                  workdir: Path) -> dict[str, Any]:
    db_url = f"sqlite:///{workdir / 'store.db'}"
    db = open_db(db_url)
    with Session(db) as s:
        for name in rates:
            policy_lines.create(s, name=name, training="lora", settings={})
    cfg = TrainConfig(lora=True, lora_rank=4, publish="lora", lr=1e-4, batch_sessions=BATCH, min_sessions=BATCH,
                      group_settle_s=0, max_staleness=1_000_000, poll_s=0.02, checkpoint_dir=workdir / "ckpt",
                      keep_checkpoints=1)
    trainer = Trainer(cfg, db, tiny_model_dir())
    trainer.scheduler = scheduler
    steps: list[dict[str, Any]] = []
    inner = trainer._step

    def noted(line: Line, batch: Batch) -> bool:
        began = time.monotonic()
        done = inner(line, batch)
        steps.append({"line": line.name, "start": began, "seconds": time.monotonic() - began,
                      "sessions": list(batch.session_ids)})
        return done

    trainer._step = noted  # type: ignore[method-assign]
    stop = threading.Event()
    ready_at: dict[str, float] = {}
    feeder = threading.Thread(target=_feed, args=(db_url, rates, stop, ready_at), daemon=True)
    began = time.monotonic()
    feeder.start()
    try:
        while time.monotonic() - began < seconds:
            if not trainer.step_once():
                time.sleep(cfg.poll_s)
    finally:
        stop.set()
        feeder.join()
        trainer.close()
    waits: dict[str, list[float]] = {name: [] for name in rates}
    for step in steps:
        arrivals = sorted(ready_at[sid] for sid in step["sessions"])
        waits[step["line"]].append(step["start"] - arrivals[min(BATCH, len(arrivals)) - 1])
    offered = {name: sum(1 for sid in ready_at if sid.startswith(f"{name}-")) for name in rates}
    return {"steps": {name: sum(1 for s in steps if s["line"] == name) for name in rates},
            "sessions_offered": offered, "waits_s": waits,
            "step_seconds_p50": statistics.median(s["seconds"] for s in steps) if steps else None,
            "order": "".join("B" if s["line"] == "busy" else "q" for s in steps)}



def scheduler_part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    seconds = args.seconds or 60.0
    rates = {"busy": 10 * args.quiet_rate, "quiet": args.quiet_rate}
    raw: dict[str, Any] = {"rates_sessions_per_s": rates, "batch_sessions": BATCH, "seconds": seconds}
    table = ResultTable(f"Scheduler: two policies, {rates['busy']:g} and {rates['quiet']:g} sessions/s, {BATCH} "
                        f"sessions per step, {seconds:g} s each",
                        ["scheduler", "busy steps", "quiet steps", "quiet sessions trained / offered",
                         "quiet wait p50 s", "quiet wait max s", "busy sessions trained / offered", "step p50 s"])
    for name, scheduler in (("fair (least recently stepped)", FairScheduler()),
                            ("greedy (most ready)", GreedyScheduler())):
        console.rule(f"scheduler: {name}, {seconds:g} s")
        with tempfile.TemporaryDirectory() as tmp:
            result = run_scheduler(scheduler, seconds, rates, Path(tmp))
        raw[name] = result
        quiet = result["waits_s"]["quiet"]
        table.add(name, result["steps"]["busy"], result["steps"]["quiet"],
                  f"{result['steps']['quiet'] * BATCH} / {result['sessions_offered']['quiet']}",
                  f"{statistics.median(quiet):.2f}" if quiet else "never stepped",
                  f"{max(quiet):.2f}" if quiet else "-",
                  f"{result['steps']['busy'] * BATCH} / {result['sessions_offered']['busy']}",
                  f"{result['step_seconds_p50']:.2f}" if result["step_seconds_p50"] else "-")
    notes = [
        "Scheduler: driven through the real trainer loop (trainer/loop.py) on the tiny random Llama "
        "(tracetrain.engines.models.tiny_model_dir), LoRA rank 4, one adapter and optimizer per policy on one "
        "base model, against a real SQLite store; a feeder thread writes finished rewarded sessions in real time.",
        "Scheduler, quiet wait: from the moment a quiet batch's last needed session was ready to the start of the "
        "step that trained it. Under fair turns it is at most about one busy step plus the scheduler's poll; "
        "under the greedy rule the quiet line steps only when the busy one's queue happens to be shorter.",
        "Scheduler, sessions offered: written by the feeder during the run. The busy rate is meant to exceed what "
        "the trainer steps, so that the busy line has a batch ready at nearly every turn; busy sessions trained / "
        "offered shows how far it did. The two runs follow each other: their step times differ with the "
        "machine's load.",
    ]
    return Part("scheduler", command, provenance(started), [table], notes, raw)


