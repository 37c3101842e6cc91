"""Publishing one version to every replica of a `ReplicaSet`, so that no call records a version its
replica did not serve.

- LoRA: the adapter is loaded into every replica in service first; then all of them switch to it at
  once (no await in between, so no request is routed in a mixed state); a replica whose load or probe
  fails is taken out, still holding the old version, and the failure is recorded in the set's events.
  When every replica refuses the version, none is taken out: each keeps serving its previous, proven
  adapter, and the refused one is unloaded.
- Full weights: one replica at a time is drained from routing (its sessions spill to the others),
  reloaded in place and put back, so serving never stops; during the roll replicas serve different
  versions, and each call records its own replica's.

A replica that rejoins (after a failure or a restart) is first brought to the latest version by
`catch_up`. Publishing fails (`PublishError`, the old version still served) only when no replica took
the new version.

Other gateway processes may send to the same replicas (`serve --workers N`, several gateway hosts on
one store). A full-weight reload then goes through a `ReloadCoordinator`: it returns from `begin_reload`
once no other process sends to the replica, and `end_reload` tells them which version it now holds,
which they label their calls with before they route to it again (proxy/replica_sync.py, over the store).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol, cast

from tracetrain.config import DEFAULT_POLICY

from .probe import ProbeCheck
from .publishing import Checkpoint, PublishError
from .replicas import ReplicaSet
from .vllm_publish import VLLMLoRAPublisher, VLLMReloadPublisher

log = logging.getLogger(__name__)

UNKNOWN_WEIGHTS = -1
"""The version label of a replica whose weights failed their probe."""


class ReloadCoordinator(Protocol):
    """Agreement with the other gateway processes in front of the same replicas on a full-weight reload."""

    async def begin_reload(self, url: str, version: int, *, forward_only: bool = False) -> int | None:
        """None once this process may reload `url`: no other process sends calls to it. Or the version `url`
        holds, when another process already brought it to `version` (catching up after a failure), or past
        it with `forward_only` (following a version another process published): nothing to reload.
        `PublishError` if the other processes did not stop in time."""

    async def end_reload(self, url: str, version: int | None, checkpoint: Path | None, failure: str | None) -> None:
        """`url` now holds `version` from `checkpoint` (None: what it held before); other processes label
        their calls with it and route to it again, unless `failure` says why it is out."""


class ReplicaPublisher:
    pauses_engine = False
    """Full-weight reloads drain one replica at a time instead of holding every generation."""

    def __init__(self, replicas: ReplicaSet, publishers: list[VLLMLoRAPublisher] | list[VLLMReloadPublisher], *,
                 canary_share: float = 0.2, probe: ProbeCheck | None = None) -> None:
        if len(publishers) != len(replicas.replicas):
            raise ValueError("one publisher per replica")
        self.replicas = replicas
        self.publishers = publishers
        self.canary_share = canary_share
        """Full weights: the share of replicas (at least one, never all) a canary is loaded into."""
        self.latest: Checkpoint | None = None
        """The last version published, which a rejoining replica catches up to."""
        self.canary: Checkpoint | None = None
        """A canary staged next to `latest` (canary promotion), which a rejoining replica loads too."""
        self.lines: dict[str, Checkpoint] = {}
        """Named policies' versions served, by policy, which a rejoining replica loads too."""
        self.line_canaries: dict[str, Checkpoint] = {}
        """Named policies' canaries on trial, by policy, which a rejoining replica stages too."""
        self.coordinator: ReloadCoordinator | None = None
        """Set when other gateway processes may send to these replicas: full-weight reloads go through it."""
        self.probe = probe
        """Checks each replica's logprobs against the trainer's after a load (engines/probe.py)."""
        self.probes: dict[tuple[str, int], dict[str, dict[str, float | bool]]] = {}
        """Probe figures by (policy line, version), then by replica URL: what the gateway records on the
        version's row."""
        self._lock = asyncio.Lock()
        replicas.catch_up = self.catch_up

    @property
    def reloads_in_place(self) -> bool:
        """Full weights: each replica's weights change under the calls other gateway processes send it."""
        return all(isinstance(p, VLLMReloadPublisher) for p in self.publishers)

    @property
    def base_weights(self) -> Path:
        """The servers' own model directory (version 0 of a full-weight replica)."""
        return cast(list[VLLMReloadPublisher], self.publishers)[0].server_model_dir

    async def publish(self, checkpoint: Checkpoint) -> None:
        async with self._lock:
            targets = [i for i, up in enumerate(self.replicas.router.up) if up]
            if not targets:
                raise PublishError("no replica is in service to publish to")
            if checkpoint.kind == "lora":
                failures = await self._publish_lora(checkpoint, targets)
            else:
                failures = await self._publish_rolling(checkpoint, targets)
            if len(failures) == len(targets):
                raise PublishError("; ".join(failures.values()))
            self.latest = checkpoint

    async def publish_line(self, checkpoint: Checkpoint) -> None:
        """A named policy's version (docs/architecture.md, decision 13) as its own adapter in every replica in
        service, each proven by the probe first; a replica that fails is taken out, the others switch that
        policy's requests to it together. Other lines keep what they serve."""
        async with self._lock:
            lora = self._lora()
            targets = [i for i, up in enumerate(self.replicas.router.up) if up]
            if not targets:
                raise PublishError("no replica is in service to publish to")

            async def load(i: int) -> None:
                await lora[i].load_line(checkpoint)
                await self._verify(i, checkpoint, lora[i].line_adapter(checkpoint))

            results = await asyncio.gather(*(load(i) for i in targets), return_exceptions=True)
            failures = {i: f"{lora[i].engine.base_url}: {r}" for i, r in zip(targets, results, strict=True)
                        if isinstance(r, BaseException)}
            if len(failures) == len(targets):
                raise PublishError("; ".join(failures.values()))
            for i, reason in failures.items():
                self._failed(i, checkpoint, reason)
            await asyncio.gather(*(lora[i].switch_line(checkpoint) for i in targets if i not in failures))
            self.lines[checkpoint.line] = checkpoint

    async def adopt(self, checkpoint: Checkpoint) -> None:
        """Serve a version another gateway process on the same store published into these replicas: a
        LoRA adapter it already loaded is only switched to (loaded where it is missing); full weights
        are already in the servers, so only the version label moves (see `gateway.workers` for why
        several processes publish LoRA only)."""
        async with self._lock:
            if checkpoint.line != DEFAULT_POLICY:
                lora = self._lora()
                for i, up in enumerate(self.replicas.router.up):
                    if up and not await lora[i].is_loaded(checkpoint):
                        await lora[i].load_line(checkpoint)
                for i, up in enumerate(self.replicas.router.up):
                    if up:
                        lora[i].engine.use_line(checkpoint.line, lora[i].line_adapter(checkpoint), checkpoint.version)
                self.lines[checkpoint.line] = checkpoint
                return
            if checkpoint.kind == "lora":
                lora = cast(list[VLLMLoRAPublisher], self.publishers)
                for i, up in enumerate(self.replicas.router.up):
                    if not up:
                        continue
                    if not await lora[i].is_loaded(checkpoint):
                        await lora[i].load(checkpoint)
                    lora[i].switch(checkpoint)
            elif self.coordinator is None:
                for replica in self.replicas.replicas:
                    replica.engine.use_adapter(None, checkpoint.version)
            else:
                # Each replica's label follows the store's record of its weights. One the store records as
                # older is reloaded, agreed with the other processes: a gateway restarted on its store
                # starts its servers on the base weights, and labelling them with the version would be a lie.
                for i, up in enumerate(self.replicas.router.up):
                    if up and self.replicas.replicas[i].engine.version < checkpoint.version:
                        await self._reload(i, checkpoint, forward_only=True)
            self.latest = checkpoint

    async def catch_up(self, index: int) -> None:
        """Bring one replica (out of service) to the latest version, and the canary if one is staged."""
        async with self._lock:
            if self.latest is not None and self.latest.kind == "full":
                await self._reload(index, self.latest)
            elif self.latest is not None:
                lora = self._lora()[index]
                await lora.load(self.latest)
                await self._verify(index, self.latest, lora.adapter_name(self.latest.version))
                lora.switch(self.latest)
                await lora.tidy()
            if self.canary is not None and self.canary.kind == "lora":
                await self._lora()[index].stage(self.canary)
            self.replicas.canary.discard(index)  # full weights: it came back with the incumbent's
            for checkpoint in self.lines.values():
                lora = self._lora()[index]
                await lora.load_line(checkpoint)
                await self._verify(index, checkpoint, lora.line_adapter(checkpoint))
                await lora.switch_line(checkpoint)
            for checkpoint in self.line_canaries.values():
                await self._stage_verified(index, checkpoint)

    # --- canary promotion (LoRA only: both versions in every replica) -------------------------------

    async def stage(self, checkpoint: Checkpoint) -> None:
        """LoRA: load a canary into every replica in service; a replica that fails is taken out. Full
        weights: reload a subset of the replicas with it (`promotion.canary_share` of them, at least one, never all):
        the replica set routes only the canary's sessions there."""
        if checkpoint.kind == "full":
            await self._stage_full(checkpoint)
            return
        async with self._lock:
            lora = self._lora()
            targets = [i for i, up in enumerate(self.replicas.router.up) if up]
            results = await asyncio.gather(*(self._stage_verified(i, checkpoint) for i in targets),
                                           return_exceptions=True)
            failures = {i: f"{lora[i].engine.base_url}: {r}" for i, r in zip(targets, results, strict=True)
                        if isinstance(r, BaseException)}
            if targets and len(failures) == len(targets):
                raise PublishError("; ".join(failures.values()))
            for i, reason in failures.items():
                self._failed(i, checkpoint, reason)
            if checkpoint.line == DEFAULT_POLICY:
                self.canary = checkpoint
            else:
                self.line_canaries[checkpoint.line] = checkpoint

    async def _stage_verified(self, index: int, checkpoint: Checkpoint) -> None:
        lora = self._lora()[index]
        await lora.stage(checkpoint)
        try:
            await self._verify(index, checkpoint, lora.adapter_for(checkpoint))
        except PublishError:
            await lora.retire(checkpoint.version, checkpoint.line)
            raise

    async def promote(self, checkpoint: Checkpoint) -> None:
        if checkpoint.line != DEFAULT_POLICY:
            async with self._lock:
                lora = self._lora()
                targets = [i for i, up in enumerate(self.replicas.router.up) if up]
                await asyncio.gather(*(lora[i].promote(checkpoint) for i in targets))
                self.lines[checkpoint.line] = checkpoint
                self.line_canaries.pop(checkpoint.line, None)
            return
        if checkpoint.kind == "full":
            async with self._lock:
                others = [i for i, up in enumerate(self.replicas.router.up) if up and i not in self.replicas.canary]
                self.replicas.canary.clear()  # the canary's replicas serve everyone from now on
                self.replicas.canary_version = None
                await self._publish_rolling(checkpoint, others)
                self.latest, self.canary = checkpoint, None
            return
        async with self._lock:
            lora = self._lora()
            targets = [i for i, up in enumerate(self.replicas.router.up) if up]
            for i in targets:  # loaded already: the switches happen in one synchronous pass
                if checkpoint.version not in lora[i].engine.adapters:
                    await lora[i].load(checkpoint)
            for i in targets:
                lora[i].switch(checkpoint)
            await asyncio.gather(*(lora[i].tidy() for i in targets), return_exceptions=True)
            self.latest, self.canary = checkpoint, None

    async def retire(self, version: int, line: str = DEFAULT_POLICY) -> None:
        async with self._lock:
            if line != DEFAULT_POLICY:
                await asyncio.gather(*(p.retire(version, line) for p in self._lora()), return_exceptions=True)
                self.line_canaries.pop(line, None)
                return
            if self.canary is not None and self.canary.kind == "full":
                # Back to the incumbent's weights; the replicas take no incumbent traffic until then.
                await self._publish_rolling(self._incumbent(), sorted(self.replicas.canary))
                self.replicas.canary.clear()
                self.replicas.canary_version = None
            else:
                await asyncio.gather(*(p.retire(version) for p in self._lora()), return_exceptions=True)
            self.canary = None

    async def _stage_full(self, checkpoint: Checkpoint) -> None:
        async with self._lock:
            up = [i for i, u in enumerate(self.replicas.router.up) if u]
            if len(up) < 2:
                raise PublishError("a full-weight canary needs two replicas in service: one keeps serving the "
                                   "incumbent")
            subset = up[-max(1, min(len(up) - 1, round(self.canary_share * len(up)))):]
            self.replicas.canary, self.replicas.canary_version = set(subset), checkpoint.version
            failures = await self._publish_rolling(checkpoint, subset)
            self.replicas.canary -= set(failures)
            if not self.replicas.canary:
                self.replicas.canary_version = None
                raise PublishError("; ".join(failures.values()))
            self.canary = checkpoint

    def _incumbent(self) -> Checkpoint:
        """What the replicas outside a full-weight canary serve: the last version published, or the base."""
        if self.latest is not None:
            return self.latest
        return Checkpoint(self.replicas.version, self.base_weights, "full")

    def _lora(self) -> list[VLLMLoRAPublisher]:
        if not all(isinstance(p, VLLMLoRAPublisher) for p in self.publishers):
            raise PublishError("a canary needs LoRA publishing: full weights cannot hold two versions in one server")
        return cast(list[VLLMLoRAPublisher], self.publishers)

    async def _publish_lora(self, checkpoint: Checkpoint, targets: list[int]) -> dict[int, str]:
        lora = cast(list[VLLMLoRAPublisher], self.publishers)

        async def load(i: int) -> None:
            await lora[i].load(checkpoint)
            await self._verify(i, checkpoint, lora[i].adapter_name(checkpoint.version))

        results = await asyncio.gather(*(load(i) for i in targets), return_exceptions=True)
        failures = {i: f"{lora[i].engine.base_url}: {r}" for i, r in zip(targets, results, strict=True)
                    if isinstance(r, BaseException)}
        if len(failures) == len(targets):
            # A refused adapter was never switched to: each replica still serves its previous, proven one.
            # Taking them all out would turn one refused version (a rounding-sized probe miss included)
            # into an outage, so they stay in service and only the refused adapter goes.
            for i, reason in failures.items():
                self.replicas.record(i, "publish_failed", reason)
            await asyncio.gather(*(lora[i].retire(checkpoint.version) for i in targets))
            return failures
        for i, reason in failures.items():
            self._failed(i, checkpoint, reason)
        for i in targets:  # one synchronous pass: every replica switches before the next request
            if i not in failures:
                lora[i].switch(checkpoint)
        await asyncio.gather(*(lora[i].tidy() for i in targets if i not in failures))
        return failures

    async def restore(self, index: int, checkpoint: Checkpoint) -> None:
        """Reload one replica with weights it is known to have held (a reload interrupted by a process that
        died left it in an unknown state), and put it back in service."""
        async with self._lock:
            failures = await self._publish_rolling(checkpoint, [index])
        if failures:
            raise PublishError(failures[index])

    async def _publish_rolling(self, checkpoint: Checkpoint, targets: list[int]) -> dict[int, str]:
        failures: dict[int, str] = {}
        for i in targets:
            self.replicas.drain(i, f"loading version {checkpoint.version}")
            try:
                await self._reload(i, checkpoint)
            except PublishError as exc:
                failures[i] = f"{self.replicas.replicas[i].url}: {exc}"
                self._failed(i, checkpoint, failures[i])
            else:
                self.replicas.bring_back(i)
            finally:
                self.replicas.replicas[i].publishing = False
        return failures

    async def _reload(self, index: int, checkpoint: Checkpoint, *, forward_only: bool = False) -> None:
        """Reload one replica, agreed with the other gateway processes when there are any (`forward_only`:
        unless another process already brought it to this version or a newer one)."""
        if self.coordinator is None:
            await self.publishers[index].publish(checkpoint)
            await self._verify_reload(index, checkpoint)
            return
        url = self.replicas.replicas[index].url
        holds = await self.coordinator.begin_reload(url, checkpoint.version, forward_only=forward_only)
        if holds is not None:
            self.replicas.replicas[index].engine.use_adapter(None, holds)
            return
        try:
            await self.publishers[index].publish(checkpoint)
            await self._verify_reload(index, checkpoint)
        except BaseException as exc:
            # The publisher undid a failed reload (the old weights serve again), or the restore failed too
            # and the replica goes out: either way its recorded version stays.
            await asyncio.shield(self.coordinator.end_reload(url, None, None, f"{type(exc).__name__}: {exc}"))
            raise
        await asyncio.shield(self.coordinator.end_reload(url, checkpoint.version, checkpoint.path, None))

    async def _verify_reload(self, index: int, checkpoint: Checkpoint) -> None:
        engine = self.replicas.replicas[index].engine
        try:
            await self._verify(index, checkpoint, engine.model_name)
        except PublishError:
            # Its weights are neither the old version's nor the trainer's: no version may label its calls,
            # and the health check's catch-up reloads the latest before it serves again.
            engine.use_adapter(None, UNKNOWN_WEIGHTS)
            raise

    async def _verify(self, index: int, checkpoint: Checkpoint, model: str) -> None:
        """Score the checkpoint's probe on replica `index` (`model`: the adapter's name or the base model's);
        PublishError when its logprobs do not match the trainer's. Recorded either way."""
        if self.probe is None:
            return
        replica = self.replicas.replicas[index]
        try:
            result = await self.probe(replica.engine, model, checkpoint.path)
        except Exception as exc:
            raise PublishError(f"the probe could not be scored: {exc}") from exc
        if result is None:
            return
        figures = {"ok": result.ok, "mean_diff": result.mean_diff, "max_diff": result.max_diff,
                   "tolerance": result.tolerance}
        self.probes.setdefault((checkpoint.line, checkpoint.version), {})[replica.url] = figures
        what = f"version {checkpoint.version}" + ("" if checkpoint.line == DEFAULT_POLICY else
                                                  f" of policy {checkpoint.line!r}")
        self.replicas.record(index, "probe_ok" if result.ok else "probe_failed", f"{what}: {result.describe()}")
        if not result.ok:
            raise PublishError(result.describe())

    def _failed(self, index: int, checkpoint: Checkpoint, reason: str) -> None:
        self.replicas.take_out(index, f"publishing version {checkpoint.version} failed: {reason}")
        self.replicas.record(index, "publish_failed", reason)
        log.error("replica %s did not take version %d: %s", self.replicas.replicas[index].url,
                  checkpoint.version, reason)
