"""The learning loop: gather a batch (trainer/batch.py), step, checkpoint, publish, record.

Everything that must survive a restart lives in the store (policy versions with their checkpoint
and figures, which sessions each version consumed or skipped and why) or in the checkpoint directory
(weights, optimizer, running baseline, the sessions kept for replay). A restarted trainer resumes from
the latest version.

One trainer trains every named policy (docs/architecture.md, decision 13): each is a `Line` with its own
sessions, version numbers, staleness, running baseline, settings and checkpoints, and, on the local
backend, its own LoRA adapter and optimizer on the one base model. A `FairScheduler` picks which line
steps next (trainer/scheduler.py). With the default line alone, a step waits for its batch as before.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session
from transformers import AutoTokenizer

from tracetrain.config import DEFAULT_POLICY, TrainConfig
from tracetrain.engines.probe import Probe, probe_token_ids, write_probe
from tracetrain.engines.publishing import WeightSource
from tracetrain.store import leases, policy_lines, promotion
from tracetrain.trainer import checkpoint
from tracetrain.trainer.algorithms.baseline import RunningBaseline
from tracetrain.trainer.algorithms.replay import SuccessReplay
from tracetrain.trainer.backend import MultiLineBackend, StepBatch, TrainerBackend, WeightsInMemory, make_backend
from tracetrain.trainer.batch import Batch, BatchGatherer
from tracetrain.trainer.data import Sample, load_samples
from tracetrain.trainer.devices import release_cached_memory
from tracetrain.trainer.scheduler import Demand, FairScheduler
from tracetrain.trainer.step import rl_advantages

log = logging.getLogger(__name__)

class PublishFn(Protocol):
    def __call__(self, version: int, path: Path, kind: str, *, weights: WeightSource | None = None) -> None:
        """Have the engine serve the checkpoint in `path` (kind 'full' or 'lora'); raise if it could not.
        `weights`: the same full weights in this process's memory, for a publisher that can send them."""
LinePublishFn = Callable[[str, int, Path], None]
"""(named policy, version, LoRA adapter dir) -> None: a named line's version; raises if the engine could not take it."""
POLICIES_DIR = "policies"
"""Named lines' checkpoints go in `<checkpoint_dir>/policies/<name>/`: beside the default line's version
directories, which stay where they were so that old stores resume, and out of reach of their pruning."""


@dataclass
class Line:
    """One named policy's line as this trainer trains it."""

    name: str
    cfg: TrainConfig
    """The trainer's settings with the policy's own (`PolicyLine.settings`) on top."""
    root: Path
    """Its checkpoint directory."""
    version: int = 0
    resume: Path | None = None
    """The checkpoint its weights continue from (canary promotion: never a rolled-back one); None: the base."""
    baseline: RunningBaseline = field(default_factory=RunningBaseline)
    counts: dict[str, Any] = field(default_factory=lambda: {"steps": 0, "samples": 0, "stale": 0,
                                                            "zero_variance": 0, "publish_failures": 0})
    """Running totals; `stale`, `zero_variance`, ...: sessions set aside by gathering, by reason."""
    batches: BatchGatherer | None = None
    replay: SuccessReplay | None = None
    """Past successes trained on again (`train.replay_successes`); None: off."""


def _replay(cfg: TrainConfig) -> SuccessReplay | None:
    return SuccessReplay(cfg.replay_successes, cfg.replay_max_age, cfg.seed) if cfg.replay_successes else None


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
                 hold: Callable[[bool], None] | None = None, publish_line: LinePublishFn | None = None) -> None:
        self.cfg = cfg
        self._merged = cfg.publishes_merged()
        self.db = db
        self.base_dir = base_dir
        self.publish = publish
        self.publish_line = publish_line
        """Publishes a named line's version; None: named lines are trained and recorded, not published here."""
        self.hold = hold
        """Called with True while a step trains and False after: `sync` mode pauses generation with it."""
        self.trainer_id = f"trainer-{uuid.uuid4().hex[:8]}"
        self.scheduler = FairScheduler()
        self._refused: set[str] = set()
        """Named lines this trainer cannot train (said once in the log)."""
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="tracetrain-publish")
        self._publishing: Future[None] | None = None
        """The version being published while the next step trains (`train.publish_overlap`)."""
        self._state_write: Future[None] | None = None
        """The newest version's sharded state being written (trainer/checkpoint.py `write_state`)."""
        torch.manual_seed(cfg.seed)
        self.lines: dict[str, Line] = {DEFAULT_POLICY: self._open_line(DEFAULT_POLICY, cfg, cfg.checkpoint_dir)}
        self.probe_ids: list[int] = probe_token_ids(AutoTokenizer.from_pretrained(str(base_dir)))
        """Tokens every checkpoint's probe scores, so that each replica can prove it serves the new weights."""
        self.backend: TrainerBackend = self._load()
        if self.line is not None:
            log.info("resumed at version %d from %s", self.version, self.line)
        self.refresh_lines()

    # The default line's state, by the names the single-line trainer had.
    @property
    def version(self) -> int:
        return self.lines[DEFAULT_POLICY].version

    @property
    def line(self) -> Path | None:
        """The checkpoint the default line's weights continue from."""
        return self.lines[DEFAULT_POLICY].resume

    @property
    def counts(self) -> dict[str, Any]:
        return self.lines[DEFAULT_POLICY].counts

    @property
    def baseline(self) -> RunningBaseline:
        return self.lines[DEFAULT_POLICY].baseline

    @property
    def batches(self) -> BatchGatherer:
        return cast(BatchGatherer, self.lines[DEFAULT_POLICY].batches)

    def _open_line(self, name: str, cfg: TrainConfig, root: Path) -> Line:
        """A line as the store and its newest checkpoint leave it: numbering goes on from its newest version,
        the weights come from the newest one not rolled back."""
        with Session(self.db) as s:
            latest = leases.latest_policy(s, line=name)
            weights = promotion.incumbent(s, line=name) if latest and latest.promotion == promotion.ROLLED_BACK \
                else latest
        line = Line(name, cfg, root, version=latest.version if latest else 0,
                    resume=Path(weights.checkpoint) if weights and weights.checkpoint else None,
                    baseline=RunningBaseline(cfg.baseline_momentum),
                    batches=BatchGatherer(cfg, self.db, self.trainer_id, policy=name), replay=_replay(cfg))
        self._restore(line, counts=True)
        return line

    def _restore(self, line: Line, *, counts: bool) -> None:
        """The running baseline and the successes kept for replay (with `counts`, the running totals too: a
        restart, not a rollback, whose totals go on) of the checkpoint the line continues from."""
        if line.resume is None:
            return
        checkpoint.check_base(line.resume, self.base_dir)
        state = checkpoint.load_state(line.resume)
        line.baseline = RunningBaseline.from_state(state["baseline"])
        if line.replay is not None and state.get("replay"):
            with Session(self.db) as s:
                kept = load_samples(s, [sid for sid, _ in state["replay"]], gamma=line.cfg.gamma)
            line.replay.restore(state["replay"], {x.session_id: x for x in kept})
        if counts:
            line.counts.update(state.get("counts", {}))

    def _load(self) -> TrainerBackend:
        """A backend with the default line's weights (or the base model's), and each named line's adapter."""
        backend = make_backend(self.cfg, self.base_dir, self.lines[DEFAULT_POLICY].resume)
        if isinstance(backend, MultiLineBackend):
            for line in self.lines.values():
                if line.name != DEFAULT_POLICY:
                    backend.add_line(line.name, line.cfg, line.resume)
        return backend

    def refresh_lines(self) -> list[str]:
        """Take on the named policies created since (`POST /v1/policies`, the config); returns the new ones."""
        with Session(self.db) as s:
            stored = [(x.name, x.training, dict(x.settings)) for x in policy_lines.listed(s)]
        added = []
        for name, training, settings in stored:
            if name in self.lines or name in self._refused or name == DEFAULT_POLICY:
                continue
            why = self._cannot_train(training)
            if why:
                self._refused.add(name)
                log.warning("policy %r is not trained: %s", name, why)
                continue
            overrides = {k: v for k, v in settings.items() if k != "retention_days"}
            cfg = TrainConfig.model_validate({**self.cfg.model_dump(), **overrides})
            line = self._open_line(name, cfg, self.cfg.checkpoint_dir / POLICIES_DIR / name)
            cast(MultiLineBackend, self.backend).add_line(name, cfg, line.resume)
            self.lines[name] = line
            added.append(name)
            log.info("training policy %r from version %d (%s)", name, line.version,
                     line.resume or "the base model")
        return added

    def _cannot_train(self, training: str) -> str | None:
        if training != "lora":
            return f"it asks for {training!r} training"
        if not self.cfg.lora or self.serves_merged:
            return "this trainer trains full weights or publishes merged ones (train.lora, train.publish)"
        if not isinstance(self.backend, MultiLineBackend):
            return "the fsdp backend trains the default policy only"
        return None

    def run(self, stop: threading.Event) -> None:
        """Step whenever a batch is gathered, until `stop` is set or max_steps is reached."""
        log.info("trainer %s at version %d: %s/%s, mode %s, max staleness %d, %d sessions per step",
                 self.trainer_id, self.version, self.cfg.advantage, self.cfg.policy_loss, self.cfg.mode,
                 self.cfg.max_staleness, self.cfg.batch_sessions)
        try:
            while not stop.is_set():
                if self.cfg.max_steps is not None and self.steps_taken() >= self.cfg.max_steps:
                    return
                self.step_once(stop)
        finally:
            self.close()

    def steps_taken(self) -> int:
        return sum(int(line.counts["steps"]) for line in self.lines.values())

    def follow_promotion(self, stop: threading.Event | None = None, name: str = DEFAULT_POLICY) -> bool:
        """Under canary promotion a line's last version published may still be on trial: wait for its decision
        (with `stop`, until stopped; without, look once). Rolled back, training continues from the line's
        incumbent's weights; its sessions are set aside by the store. False while undecided."""
        line = self.lines[name]
        while True:
            with Session(self.db) as s:
                current = promotion.version_row(s, version=line.version, line=name)
                state = current.promotion if current else None
                incumbent = promotion.incumbent(s, line=name) if state == promotion.ROLLED_BACK else None
            if state != "canary":
                break
            if stop is None or stop.wait(self.cfg.poll_s):
                return False
        if state == promotion.ROLLED_BACK:
            resume = Path(incumbent.checkpoint) if incumbent and incumbent.checkpoint else None
            if resume != line.resume:
                log.warning("version %d of line %r was rolled back: training continues from %s", line.version, name,
                            f"version {incumbent.version}" if incumbent else "the base model")
                # Every line is reloaded from its own checkpoint (the others' newest): one base model holds them all.
                self.wait_for_state()
                self.backend.close()
                line.baseline = RunningBaseline(line.cfg.baseline_momentum)
                line.replay = _replay(line.cfg)  # the incumbent's own, not those of the weights rolled back
                line.resume = resume
                self._restore(line, counts=False)
                self.backend = self._load()
        return True

    def step_once(self, stop: threading.Event | None = None) -> bool:
        """Gather a batch, train, checkpoint, publish. With `stop`, waits for the batch (see
        trainer/batch.py) until stopped; without, looks once. False when no step was taken. With named
        policies, the scheduler picks the line (trainer/scheduler.py)."""
        self.refresh_lines()
        if len(self.lines) == 1:
            if not self.follow_promotion(stop):
                return False
            batch = self.batches.gather(self.version, stop)
            return batch is not None and self._step(self.lines[DEFAULT_POLICY], batch)
        while True:
            for name in self.scheduler.due(self._demands(), time.monotonic()):
                if not self.follow_promotion(name=name):
                    continue
                line = self.lines[name]
                batch = cast(BatchGatherer, line.batches).gather(line.version)  # ready now: no waiting
                if batch is not None:
                    self.scheduler.stepped(name)
                    return self._step(line, batch)
            if stop is None or stop.wait(self.cfg.poll_s):
                return False
            self.refresh_lines()

    def _demands(self) -> dict[str, Demand]:
        with Session(self.db) as s:
            ready = leases.ready_counts(s)
        return {name: Demand(ready.get(name, 0), line.cfg.batch_sessions, line.cfg.min_sessions,
                             line.cfg.fill_timeout_s) for name, line in self.lines.items()}

    def _step(self, line: Line, batch: Batch) -> bool:
        gathered = batch.figures(line.version)
        for reason, n in batch.set_aside.items():
            line.counts[reason] = line.counts.get(reason, 0) + n
        if batch.set_aside["stale"] >= line.cfg.batch_sessions:
            # Most often rewards that arrive more versions late than the bound: data thrown away unseen.
            log.warning("line %r: %d sessions set aside as stale while gathering one batch of %d: their rewards came "
                        "more than train.max_staleness=%d versions after they were sampled; a higher bound trains on "
                        "them (docs/architecture.md, 'Late rewards')", line.name, batch.set_aside["stale"],
                        line.cfg.batch_sessions, line.cfg.max_staleness)
        if self.hold:
            self.hold(True)
        try:
            if isinstance(self.backend, MultiLineBackend):
                self.backend.use_line(line.name)
            figures = self._train(line, batch.samples)
            if self.hold:  # sync mode: the engine may wake into this GPU's memory for the publish below
                release_cached_memory()
            line.version += 1
            began = time.perf_counter()
            path = self._checkpoint(line)
            figures["checkpoint_seconds"] = time.perf_counter() - began
            line.resume = path.resolve()
            figures = {**figures, **gathered}
            self._record(line, path, {**figures, "time_s": step_times(figures)}, batch.samples, batch.session_ids)
            self._publish_after(line, path)
        except BaseException:
            cast(BatchGatherer, line.batches).release(batch)
            raise
        finally:
            if self.hold:
                self.hold(False)
        return True

    def _train(self, line: Line, samples: list[Sample]) -> dict[str, Any]:
        cfg = line.cfg
        advantages = rl_advantages(samples, cfg, line.baseline) if cfg.algorithm == "rl" else None
        replayed: list[Sample] = []
        if line.replay is not None and advantages is not None:
            replayed, again = line.replay.draw(line.version, line.baseline)
            line.replay.keep(samples, advantages, line.version)  # after the draw: not replayed in its own step
            advantages = advantages + again
        figures = self.backend.step(StepBatch(samples + replayed, advantages))
        rewards = [x.reward for x in samples]
        line.counts["steps"] += 1
        line.counts["samples"] += len(samples)
        # Running totals first, so that this step's own figures (its `samples` above all) win.
        spread = {"advantage_std": statistics.pstdev(advantages)} if advantages else {}
        if line.replay is not None:
            spread["replayed"] = len(replayed)
        return {**line.counts, "samples_total": line.counts["samples"], **figures, **spread,
                "reward_mean": sum(rewards) / len(rewards), "samples": len(samples),
                "behaviour_versions": sorted({x.oldest_version for x in samples})}

    def _checkpoint(self, line: Line) -> Path:
        state = {"baseline": line.baseline.state_dict(), "counts": dict(line.counts), "version": line.version,
                 "base_model": checkpoint.architecture(self.base_dir), "policy": line.name,
                 "replay": line.replay.state_dict() if line.replay is not None else []}
        merged = self.serves_merged and line.name == DEFAULT_POLICY

        def write(tmp: Path) -> None:
            self.backend.save(tmp, merged=merged)
            served = tmp / checkpoint.MERGED_DIR if merged else tmp
            write_probe(served, Probe(self.probe_ids, self.backend.logprobs(self.probe_ids), self.cfg.dtype))

        self.wait_for_state()
        path = checkpoint.save_version(line.root, line.version, write, self.base_dir, state,
                                       self.cfg.keep_checkpoints, merged=merged, protect=line.resume)
        # only to resume from: the local backend writes it while the next step gathers and trains
        self._state_write = checkpoint.write_state(path, self.backend.save_state)
        return path

    def wait_for_state(self) -> None:
        """Block until the newest version's sharded state is in place; raise if writing it failed."""
        if self._state_write is not None:
            pending, self._state_write = self._state_write, None
            pending.result()

    def close(self) -> None:
        self.wait_for_publish()
        self._publisher.shutdown()
        try:
            self.wait_for_state()
        finally:
            self.backend.close()

    @property
    def serves_merged(self) -> bool:
        """LoRA training published as full weights (see `TrainConfig.publishes_merged`)."""
        return self._merged

    @property
    def kind(self) -> str:
        return "lora" if self.cfg.lora and not self.serves_merged else "full"

    def _record(self, line: Line, path: Path, figures: dict[str, Any], samples: list[Sample],
                session_ids: list[str]) -> None:
        """Record the version and mark its sessions consumed, in one transaction (`promotion.record_trained`)."""
        kind = self.kind if line.name == DEFAULT_POLICY else "lora"
        with Session(self.db) as s:
            promotion.record_trained(s, line=line.name, version=line.version, checkpoint=path, kind=kind,
                                     metrics=figures, trainer_id=self.trainer_id, session_ids=session_ids)
        peaks = [round(m["peak_bytes"] / 2**20) for m in figures.get("memory", [])]
        log.info("%s version %d: reward %.3f over %d samples of %d sessions (staleness %s, gathered in %.1fs), "
                 "loss %.4f, %.0f tokens/s, peak memory per worker %s MiB; set aside this step %s, in all stale %d, "
                 "zero-variance %d", "" if line.name == DEFAULT_POLICY else f"policy {line.name!r}", line.version,
                 figures["reward_mean"], len(samples), figures["sessions"], figures["staleness"],
                 figures["gather_seconds"], figures.get("loss", 0.0), figures.get("tokens_per_second", 0.0), peaks,
                 figures["set_aside"] or "none", line.counts["stale"], line.counts["zero_variance"])

    def _publish_after(self, line: Line, path: Path) -> None:
        """Publish now, or with `publish_overlap` on the publishing thread once the previous version's is done
        (the step after this one trains meanwhile)."""
        if not self.cfg.publish_overlap or self.hold is not None:
            self._publish(line, line.version, path)
            return
        self.wait_for_publish()
        self._publishing = self._publisher.submit(self._publish, line, line.version, path)

    def _in_memory(self) -> WeightSource | None:
        """The full weights just checkpointed, as they are in this process, for a publisher that sends them into
        the engine from memory. None under `publish_overlap`: the next step would change them under the
        transfer."""
        if self.kind != "full" or self.cfg.publish_overlap or not isinstance(self.backend, WeightsInMemory):
            return None
        return functools.partial(self.backend.served_weights, merged=self.serves_merged)

    def wait_for_publish(self) -> None:
        """Block until the version being published in the background (if any) is published or has failed."""
        if self._publishing is not None:
            self._publishing.result()
            self._publishing = None

    def _publish(self, line: Line, version: int, path: Path) -> None:
        if line.name == DEFAULT_POLICY:
            if self.publish is None:
                return
            served = path / checkpoint.MERGED_DIR if self.serves_merged else path
            hand_over = functools.partial(self.publish, version, served, self.kind, weights=self._in_memory())
        else:
            if self.publish_line is None:
                return
            hand_over = functools.partial(self.publish_line, line.name, version, path)
        started = time.perf_counter()
        error = None
        try:
            hand_over()
        except Exception as exc:  # the engine keeps serving the old version; say so and go on
            error = f"{type(exc).__name__}: {exc}"
            line.counts["publish_failures"] += 1
            log.error("publishing %s version %d failed, the engine keeps the previous one: %s", line.name,
                      version, error)
        with Session(self.db) as s:
            promotion.record_publish(s, line=line.name, version=version, error=error,
                                     seconds=time.perf_counter() - started)
