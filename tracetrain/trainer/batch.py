"""Gathering one step's batch: freshest groups first, nothing unusable consumed, full batches.

Each round sets aside sessions that went stale (they stay in the store, unconsumed) and claims whole
groups freshest first. Groups whose rewards are all equal (no signal for a group baseline) are kept and
trained against the running baseline by default (`flat_groups: baseline`, trainer/step.py's
`rl_advantages`), or kept with zero advantage (`keep`). With `set_aside` they are set aside so that more
groups take their place: DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", section 3.2), with a deadline instead of a count of generation
batches because generation here is whoever the agents are, not the trainer. A step waits for
`batch_sessions` usable sessions; with at least `min_sessions` it waits at most `fill_timeout_s` more;
with fewer it waits as long as it takes rather than train on a handful.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session

from tracetrain.config import DEFAULT_POLICY, TrainConfig
from tracetrain.store import leases
from tracetrain.store.models import utcnow
from tracetrain.trainer.algorithms.importance import staleness_floor
from tracetrain.trainer.algorithms.verl_ops import GROUP_ESTIMATORS
from tracetrain.trainer.data import Sample, load_samples, zero_variance_groups


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)
    session_ids: list[str] = field(default_factory=list)
    """Claimed and usable: consumed by the step."""
    set_aside: Counter[str] = field(default_factory=Counter)
    """Sessions this step's gathering set aside, by reason."""
    started: float = field(default_factory=time.monotonic)
    claim_seconds: float = 0.0
    """Time spent claiming and loading sessions (the rest of gathering is waiting for them)."""

    def figures(self, version: int) -> dict[str, Any]:
        """What the step trained on: counts, set-aside causes, and how old it was (in versions and seconds)."""
        now = utcnow()
        ages = sorted((now - x.finished_at).total_seconds() for x in self.samples if x.finished_at is not None)
        staleness = Counter(version - x.oldest_version for x in self.samples)
        return {
            "sessions": len(self.session_ids), "set_aside": dict(self.set_aside),
            "staleness": {str(k): n for k, n in sorted(staleness.items())},
            "age_s": {"p50": statistics.median(ages), "p90": ages[int(0.9 * (len(ages) - 1))], "max": ages[-1]}
            if ages else {},
            "gather_seconds": time.monotonic() - self.started,
            "claim_seconds": self.claim_seconds,
        }


class BatchGatherer:
    def __init__(self, cfg: TrainConfig, db: DBEngine, trainer_id: str, *, policy: str = DEFAULT_POLICY) -> None:
        self.cfg = cfg
        self.db = db
        self.trainer_id = trainer_id
        self.policy = policy
        """The named policy whose sessions it gathers: a batch never mixes policies."""

    def gather(self, version: int, stop: threading.Event | None = None) -> Batch | None:
        """A full batch (or, after `fill_timeout_s`, at least `min_sessions`), or None once `stop` is set.
        Without `stop`, it does not wait: it takes what is ready now, None if that is fewer than `min_sessions`."""
        batch = Batch()
        full_by: float | None = None
        while True:
            began = time.monotonic()
            claimed = self._round(batch, version)
            batch.claim_seconds += time.monotonic() - began
            have = len(batch.session_ids)
            if have >= self.cfg.batch_sessions:
                return batch
            if claimed:
                continue  # more may be ready right away (replacing zero-variance groups)
            if have >= self.cfg.min_sessions:
                full_by = full_by or time.monotonic() + self.cfg.fill_timeout_s
                if stop is None or time.monotonic() >= full_by:
                    return batch
            if stop is None or stop.wait(self.cfg.poll_s):
                break
        self.release(batch)
        return None

    def release(self, batch: Batch) -> None:
        with Session(self.db) as s:
            leases.release_sessions(s, trainer_id=self.trainer_id, session_ids=batch.session_ids)

    def _round(self, batch: Batch, version: int) -> int:
        """Set aside what went stale, claim groups, set aside what has no signal; returns sessions claimed."""
        rl = self.cfg.algorithm == "rl"
        # Staleness bounds on-policy learning only; SFT and DPO learn from any version, and from what
        # the online trainer set aside (an all-correct group is no RL signal but fine to imitate).
        floor = staleness_floor(version, self.cfg.max_staleness) if rl else None
        with Session(self.db) as s:
            if floor is not None:
                batch.set_aside["stale"] += leases.set_aside_stale(s, min_version=floor, policy=self.policy)
            claimed = leases.claim_groups(s, trainer_id=self.trainer_id, lease_s=self.cfg.lease_s,
                                          want=self.cfg.batch_sessions - len(batch.session_ids),
                                          min_version=floor, settle_s=self.cfg.group_settle_s,
                                          include_set_aside=not rl, policy=self.policy)
            samples = load_samples(s, claimed, gamma=self.cfg.gamma)
        unusable: dict[str, set[str]] = {}
        if rl and self.cfg.advantage in GROUP_ESTIMATORS and self.cfg.flat_groups == "set_aside":
            flat = zero_variance_groups(samples)
            unusable["zero_variance"] = {x.session_id for x in samples if x.group_id in flat}
        # Every call cut off before a sampled token: nothing to learn from.
        unusable["no_samples"] = set(claimed) - {x.session_id for x in samples}
        for reason, ids in unusable.items():
            self._set_aside(batch, ids, reason)
        dropped = set().union(*unusable.values())
        batch.samples += [x for x in samples if x.session_id not in dropped]
        batch.session_ids += [i for i in claimed if i not in dropped]
        return len(claimed)

    def _set_aside(self, batch: Batch, session_ids: set[str], reason: str) -> None:
        if not session_ids:
            return
        batch.set_aside[reason] += len(session_ids)
        with Session(self.db) as s:
            leases.set_aside(s, trainer_id=self.trainer_id, session_ids=sorted(session_ids), reason=reason)

