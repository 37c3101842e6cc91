"""The learning loop: gather a batch (trainer/batch.py), step, checkpoint, publish, record.

Everything that must survive a restart lives in the store (policy versions with their checkpoint
and figures, which sessions each version consumed or skipped and why) or in the checkpoint directory
(weights, optimizer, running baseline). A restarted trainer resumes from the latest version.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session
from transformers import AutoTokenizer

from tracetrain.config import TrainConfig
from tracetrain.engines.probe import PROBE_TEXT, Probe, write_probe
from tracetrain.store import leases, promotion
from tracetrain.store.models import Policy, utcnow
from tracetrain.trainer import checkpoint
from tracetrain.trainer.algorithms.baseline import RunningBaseline
from tracetrain.trainer.backend import StepBatch, TrainerBackend, make_backend
from tracetrain.trainer.batch import BatchGatherer
from tracetrain.trainer.data import Sample
from tracetrain.trainer.devices import release_cached_memory
from tracetrain.trainer.step import rl_advantages

log = logging.getLogger(__name__)

PublishFn = Callable[[int, Path, str], None]
"""(version, checkpoint dir, kind 'full'|'lora') -> None; raises if the engine could not take it."""


def step_times(figures: dict[str, Any]) -> dict[str, float]:
    """Where a step's time went, in the order it was spent (seconds): waiting for sessions to be ready,
    claiming and loading them, the forward and backward passes, the optimizer, the checkpoint. The
    publish is added once it is done, and the gateway records the first call the version serves
    (`Policy.first_call_at`)."""
    times = {"wait_data": figures["gather_seconds"] - figures.get("claim_seconds", 0.0),
             "claim": figures.get("claim_seconds", 0.0)}
    if "forward_backward_seconds" in figures:  # the local backend times them apart
        times |= {"forward_backward": figures["forward_backward_seconds"], "optimizer": figures["optimizer_seconds"]}
    elif "step_seconds" in figures:
        times["step"] = figures["step_seconds"]
    return {**times, "checkpoint": figures["checkpoint_seconds"]}


class Trainer:
    def __init__(self, cfg: TrainConfig, db: DBEngine, base_dir: Path, *, publish: PublishFn | None = None,
                 hold: Callable[[bool], None] | None = None) -> None:
        self.cfg = cfg
        self._merged = cfg.publishes_merged()
        self.db = db
        self.base_dir = base_dir
        self.publish = publish
        self.hold = hold
        """Called with True while a step trains and False after: `sync` mode pauses generation with it."""
        self.trainer_id = f"trainer-{uuid.uuid4().hex[:8]}"
        self.counts = {"steps": 0, "samples": 0, "stale": 0, "zero_variance": 0, "publish_failures": 0}
        """Running totals; `stale`, `zero_variance`, ...: sessions set aside by gathering, by reason."""
        self.batches = BatchGatherer(cfg, db, self.trainer_id)
        torch.manual_seed(cfg.seed)
        with Session(db) as s:
            latest = leases.latest_policy(s)
            # Numbering goes on from the newest version; the weights come from the newest one not rolled back.
            line = promotion.incumbent(s) if latest and latest.promotion == promotion.ROLLED_BACK else latest
        self.version = latest.version if latest else 0
        self.line: Path | None = Path(line.checkpoint) if line and line.checkpoint else None
        """The checkpoint the trainer's weights continue from (canary promotion: never a rolled-back one)."""
        self.baseline = RunningBaseline(cfg.baseline_momentum)
        self.probe_ids: list[int] = AutoTokenizer.from_pretrained(str(base_dir)).encode(
            PROBE_TEXT, add_special_tokens=False)
        """Tokens every checkpoint's probe scores, so that each replica can prove it serves the new weights."""
        self.backend: TrainerBackend = self._load(self.line)
        if self.line is not None:
            log.info("resumed at version %d from %s", self.version, self.line)

    def run(self, stop: threading.Event) -> None:
        """Step whenever a batch is gathered, until `stop` is set or max_steps is reached."""
        log.info("trainer %s at version %d: %s/%s, mode %s, max staleness %d, %d sessions per step",
                 self.trainer_id, self.version, self.cfg.advantage, self.cfg.policy_loss, self.cfg.mode,
                 self.cfg.max_staleness, self.cfg.batch_sessions)
        try:
            while not stop.is_set():
                if self.cfg.max_steps is not None and self.counts["steps"] >= self.cfg.max_steps:
                    return
                self.step_once(stop)
        finally:
            self.close()

    def _load(self, resume: Path | None, *, counts: bool = True) -> TrainerBackend:
        """A backend with the weights (and running baseline) of `resume`, or of the base model; with
        `counts`, the running totals too (a restart; not a rollback, whose totals go on)."""
        if resume is not None:
            checkpoint.check_base(resume, self.base_dir)
            state = checkpoint.load_state(resume)
            self.baseline = RunningBaseline.from_state(state["baseline"])
            if counts:
                self.counts.update(state.get("counts", {}))
        return make_backend(self.cfg, self.base_dir, resume)

    def follow_promotion(self, stop: threading.Event | None = None) -> bool:
        """Under canary promotion the last version published may still be on trial: wait for its decision
        (with `stop`, until stopped; without, look once). Rolled back, training continues from the
        incumbent's weights; its sessions are set aside by the store. False while undecided."""
        while True:
            with Session(self.db) as s:
                current = s.get(Policy, self.version)
                state = current.promotion if current else None
                line = promotion.incumbent(s) if state == promotion.ROLLED_BACK else None
            if state != "canary":
                break
            if stop is None or stop.wait(self.cfg.poll_s):
                return False
        if state == promotion.ROLLED_BACK:
            resume = Path(line.checkpoint) if line and line.checkpoint else None
            if resume != self.line:
                log.warning("version %d was rolled back: training continues from %s", self.version,
                            f"version {line.version}" if line else "the base model")
                self.backend.close()
                self.baseline = RunningBaseline(self.cfg.baseline_momentum)
                self.backend, self.line = self._load(resume, counts=False), resume
        return True

    def step_once(self, stop: threading.Event | None = None) -> bool:
        """Gather a batch, train, checkpoint, publish. With `stop`, waits for the batch (see
        trainer/batch.py) until stopped; without, looks once. False when no step was taken."""
        if not self.follow_promotion(stop):
            return False
        batch = self.batches.gather(self.version, stop)
        if batch is None:
            return False
        gathered = batch.figures(self.version)
        for reason, n in batch.set_aside.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        if self.hold:
            self.hold(True)
        try:
            figures = self._train(batch.samples)
            if self.hold:  # sync mode: the engine may wake into this GPU's memory for the publish below
                release_cached_memory()
            self.version += 1
            began = time.perf_counter()
            path = self._checkpoint()
            figures["checkpoint_seconds"] = time.perf_counter() - began
            self.line = path.resolve()
            figures = {**figures, **gathered}
            self._record(path, {**figures, "time_s": step_times(figures)}, batch.samples, batch.session_ids)
            self._publish(path)
        except BaseException:
            self.batches.release(batch)
            raise
        finally:
            if self.hold:
                self.hold(False)
        return True

    def _train(self, samples: list[Sample]) -> dict[str, Any]:
        advantages = rl_advantages(samples, self.cfg, self.baseline) if self.cfg.algorithm == "rl" else None
        figures = self.backend.step(StepBatch(samples, advantages))
        rewards = [x.reward for x in samples]
        self.counts["steps"] += 1
        self.counts["samples"] += len(samples)
        # Running totals first, so that this step's own figures (its `samples` above all) win.
        spread = {"advantage_std": statistics.pstdev(advantages)} if advantages else {}
        return {**self.counts, "samples_total": self.counts["samples"], **figures, **spread,
                "reward_mean": sum(rewards) / len(rewards), "samples": len(samples),
                "behaviour_versions": sorted({x.oldest_version for x in samples})}

    def _checkpoint(self) -> Path:
        state = {"baseline": self.baseline.state_dict(), "counts": dict(self.counts), "version": self.version,
                 "base_model": checkpoint.architecture(self.base_dir)}
        def write(tmp: Path) -> None:
            self.backend.save(tmp, merged=self.serves_merged)
            served = tmp / checkpoint.MERGED_DIR if self.serves_merged else tmp
            write_probe(served, Probe(self.probe_ids, self.backend.logprobs(self.probe_ids), self.cfg.dtype))

        return checkpoint.save_version(self.cfg.checkpoint_dir, self.version, write, self.base_dir,
                                       state, self.cfg.keep_checkpoints, merged=self.serves_merged,
                                       protect=self.line)

    def close(self) -> None:
        self.backend.close()

    @property
    def serves_merged(self) -> bool:
        """LoRA training published as full weights (see `TrainConfig.publishes_merged`)."""
        return self._merged

    @property
    def kind(self) -> str:
        return "lora" if self.cfg.lora and not self.serves_merged else "full"

    def _record(self, path: Path, figures: dict[str, Any], samples: list[Sample], session_ids: list[str]) -> None:
        """Record the version and mark its sessions consumed in one transaction: a trainer killed after
        this (while publishing, say) leaves no lease to lapse on sessions the recorded version learned
        from, so the next trainer, resuming from this version, cannot train them a second time."""
        with Session(self.db) as s:
            s.add(Policy(version=self.version, checkpoint=str(path.resolve()), kind=self.kind, metrics=figures))
            s.flush()
            leases.consume_sessions(s, trainer_id=self.trainer_id, session_ids=session_ids, version=self.version)
            s.commit()  # consume_sessions committed both, unless it had no sessions to mark
        peaks = [round(m["peak_bytes"] / 2**20) for m in figures.get("memory", [])]
        log.info("version %d: reward %.3f over %d samples of %d sessions (staleness %s, gathered in %.1fs), loss "
                 "%.4f, %.0f tokens/s, peak memory per worker %s MiB; set aside this step %s, in all stale %d, "
                 "zero-variance %d", self.version, figures["reward_mean"], len(samples), figures["sessions"],
                 figures["staleness"], figures["gather_seconds"], figures.get("loss", 0.0),
                 figures.get("tokens_per_second", 0.0), peaks, figures["set_aside"] or "none", self.counts["stale"],
                 self.counts["zero_variance"])

    def _publish(self, path: Path) -> None:
        if self.publish is None:
            return
        started = time.perf_counter()
        error = None
        try:
            self.publish(self.version, path / checkpoint.MERGED_DIR if self.serves_merged else path, self.kind)
        except Exception as exc:  # the engine keeps serving the old version; say so and go on
            error = f"{type(exc).__name__}: {exc}"
            self.counts["publish_failures"] += 1
            log.error("publishing version %d failed, the engine keeps the previous one: %s", self.version, error)
        with Session(self.db) as s:
            policy = s.get(Policy, self.version)
            if policy is not None:
                policy.published_at = None if error else utcnow()
                policy.publish_error = error
                seconds = time.perf_counter() - started
                times = {**policy.metrics.get("time_s", {}), "publish": seconds}
                policy.metrics = {**policy.metrics, "publish_seconds": seconds, "time_s": times}
                s.add(policy)
                s.commit()

