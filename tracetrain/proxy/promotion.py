"""Canary promotion in one gateway process (`promotion.mode: canary`), for every policy line: the default one
and each named policy (docs/architecture.md, decision 13) have a trial of their own (`Canaries`).

A new version is first *staged*: the engine holds it next to the incumbent, and only the share
`promotion.canary_share` of new sessions is assigned to it (by a hash of the session's named group, else of its
id, so every process assigns alike). A session keeps the version it started on. Every second the
canary's test (proxy/sequential.py) runs on the final rewards of the sessions each version began
since the canary started; its decision is stored (`store/promotion.py`, once, whichever process gets
there first) and applied: promoted, the canary serves everyone; rolled back, it serves no one again.

The store is the source of truth: every process mirrors it each second, so a decision taken by
another process or by an admin (`POST /v1/policies/{version}/promote|rollback`, `?policy=` for a named
one) reaches them all.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from sqlmodel import Session

from tracetrain.config import DEFAULT_POLICY, PromotionConfig
from tracetrain.engines.base import Engine
from tracetrain.engines.publishing import CanaryPublisher, Checkpoint, PublishError, line_version
from tracetrain.proxy import sequential
from tracetrain.proxy.replica_sync import Read, Write
from tracetrain.store import promotion as store
from tracetrain.store.models import Policy

log = logging.getLogger(__name__)


@dataclass
class Trial:
    checkpoint: Checkpoint
    since: datetime
    latest: sequential.Decision | None = None
    """The test's figures at its last evaluation."""


def assigned_to_canary(key: str, share: float) -> bool:
    """Whether a new session (by its group or id) belongs to the canary's share: the same in every process."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 < share


class Promotion:
    """One line's canary trial."""

    def __init__(self, config: PromotionConfig, engine: Engine, *, read: Read, write: Write,
                 publisher: CanaryPublisher | None, line: str = DEFAULT_POLICY) -> None:
        """`read` runs a query off the event loop; `write` goes through the store writer; `publisher` loads
        versions into the engine (None: this gateway does not publish)."""
        self.config = config
        self.engine = engine
        self.line = line
        self._read, self._write = read, write
        self.publisher = publisher
        self.trial: Trial | None = None
        self._lock = asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self.config.mode == "canary"

    def version_for(self, *, new: bool, key: str, pinned: int | None) -> int | None:
        """The version a call should be served by: None for the engine's current one. A stored session
        keeps its first call's; a new one gets the canary if it falls in the canary's share."""
        if not self.enabled:
            return None
        if not new:
            return pinned
        trial = self.trial
        if trial is not None and assigned_to_canary(key, self.config.canary_share):
            return trial.checkpoint.version
        return None

    # --- publishing and deciding -------------------------------------------------------------------

    async def stage(self, checkpoint: Checkpoint) -> None:
        """A new version from the trainer starts as a canary."""
        async with self._lock:
            if self.trial is not None:
                raise PublishError(f"version {self.trial.checkpoint.version} is still a canary; promote or roll it "
                                   "back first")
            await self._publisher().stage(checkpoint)
            since = await self._write(lambda db: store.mark_published(
                db, version=checkpoint.version, checkpoint=checkpoint.path, kind=checkpoint.kind, promotion="canary",
                line=self.line))
            self.trial = Trial(checkpoint, since)
            log.info("version %d%s is a canary for %.0f%% of new sessions", checkpoint.version, self._of,
                     100 * self.config.canary_share)

    @property
    def _of(self) -> str:
        return "" if self.line == DEFAULT_POLICY else f" of policy {self.line!r}"

    @property
    def served(self) -> int:
        """The line's version every session not assigned to the canary gets."""
        return line_version(self.engine, self.line)

    async def decide(self, version: int, outcome: str, decision: dict[str, Any]) -> bool:
        """Store a decision (False if the canary was decided already) and apply it here."""
        async with self._lock:
            decided = await self._write(lambda db: store.decide(
                db, version=version, outcome=outcome, decision=decision, line=self.line))
            if decided:
                log.warning("version %d%s %s: %s", version, self._of, outcome.replace("_", " "),
                            decision.get("reason"))
                await self._apply(version, outcome)
            return decided

    async def evaluate(self) -> sequential.Decision | None:
        """Run the test on the rewards so far; decide when it says so."""
        trial = self.trial
        if trial is None:
            return None
        canary_v, incumbent_v, since, line = trial.checkpoint.version, self.served, trial.since, self.line

        def rewards(db: Session) -> tuple[list[float], list[float]]:
            return (store.arm_rewards(db, version=canary_v, since=since, line=line),
                    store.arm_rewards(db, version=incumbent_v, since=since, line=line))

        canary_r, incumbent_r = await self._read(rewards)
        c = self.config
        result = sequential.decide(canary_r, incumbent_r, margin=c.margin, alpha=c.alpha,
                                   min_sessions=c.min_sessions, max_sessions=c.max_sessions)
        trial.latest = result
        if result.outcome != "wait":
            outcome = "promoted" if result.outcome == "promote" else store.ROLLED_BACK
            await self.decide(canary_v, outcome, {"by": "test", "incumbent_version": incumbent_v,
                                                  **result.as_dict()})
        return result

    async def follow(self) -> None:
        """Mirror the store: a canary staged or decided by another process, a version promoted elsewhere."""
        line = self.line

        def read(db: Session) -> tuple[Policy | None, Policy | None, Policy | None]:
            trial = self.trial
            return (store.incumbent(db, line=line), store.canary(db, line=line),
                    store.version_row(db, version=trial.checkpoint.version, line=line) if trial is not None else None)

        # Read under the lock: a snapshot taken before a decision made here (by `decide`, holding the lock)
        # still shows the decided version as the canary, and would stage it again once the lock is free.
        async with self._lock:
            incumbent, canary, ours = await self._read(read)
            if self.trial is not None and ours is not None and ours.promotion != "canary":
                await self._apply(self.trial.checkpoint.version, str(ours.promotion))
            if incumbent is not None and incumbent.version > self.served and incumbent.checkpoint:
                await self._publisher().promote(_checkpoint(incumbent))
            if canary is not None and self.trial is None and canary.canary_since is not None and \
                    canary.version > self.served and canary.checkpoint:
                await self._publisher().stage(_checkpoint(canary))
                self.trial = Trial(_checkpoint(canary), canary.canary_since)

    def state(self) -> dict[str, Any] | None:
        """The canary on trial with the test's latest figures, for `GET /v1/policies`."""
        trial = self.trial
        if trial is None:
            return None
        return {"version": trial.checkpoint.version, "policy": self.line, "since": trial.since.isoformat(),
                "share": self.config.canary_share,
                "test": trial.latest.as_dict() if trial.latest else None}

    async def _apply(self, version: int, outcome: str) -> None:
        trial = self.trial
        if trial is None or trial.checkpoint.version != version:
            return
        if outcome == "promoted":
            await self._publisher().promote(trial.checkpoint)
        else:
            await self._publisher().retire(version, self.line)
        self.trial = None

    def _publisher(self) -> CanaryPublisher:
        if self.publisher is None:
            raise PublishError("this gateway has no publisher")
        return self.publisher


class Canaries:
    """Every line's trial in this process: the default line's always, a named policy's once it has a canary
    (staged here, or found in the store staged by another process)."""

    def __init__(self, config: PromotionConfig, engine: Engine, *, read: Read, write: Write,
                 publisher: CanaryPublisher | None) -> None:
        self.config, self.engine, self._read, self._write = config, engine, read, write
        self.publisher = publisher
        self.lines: dict[str, Promotion] = {}
        self.default = self.line(DEFAULT_POLICY)

    @property
    def enabled(self) -> bool:
        return self.config.mode == "canary"

    def line(self, name: str) -> Promotion:
        """`name`'s trial, made on first use."""
        promotion = self.lines.get(name)
        if promotion is None:
            promotion = self.lines[name] = Promotion(self.config, self.engine, read=self._read, write=self._write,
                                                     publisher=self.publisher, line=name)
        return promotion

    def states(self) -> dict[str, dict[str, Any]]:
        """The canaries on trial, by line."""
        return {name: state for name, p in self.lines.items() if (state := p.state()) is not None}

    async def round(self) -> None:
        """Mirror the store and run every line's test once: every line with a version served or on trial in
        the store (staged or promoted through another process, too)."""
        for name in sorted(set(await self._read(store.lines_published)) | set(self.lines)):
            promotion = self.line(name)
            await promotion.follow()
            await promotion.evaluate()

    async def run(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.round()
            except Exception as exc:  # the store or an engine briefly away: try again next round
                log.warning("canary promotion: %s", exc)


def _checkpoint(policy: Policy) -> Checkpoint:
    return Checkpoint(policy.version, Path(cast(str, policy.checkpoint)), cast(Any, policy.kind), policy.line)
