"""vLLM asleep while a `sync`-mode step trains on the GPU it shares with the trainer (`engine.sleep`).

The trainer holds generation for its step (proxy/holds.py; through the store when it runs
in another process). Once no call is outstanding on any replica, every replica sleeps; generation then
stays closed under the holder `asleep` until they are awake again, so no call reaches a sleeping
engine. They wake when a new version is published (before it loads: LoRA loading and weight reloads
need the weights on the GPU) or when the training hold ends, whichever comes first. A publish keeps them
awake until it is done (`awake`): the training hold usually lasts until the publish returns, and the
publish's probe scores the new version on the engine itself, which a sleeping engine never answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tracetrain.engines import vllm_sleep
from tracetrain.engines.replicas import ReplicaSet
from tracetrain.proxy.holds import GenerationHolds

log = logging.getLogger(__name__)

ASLEEP = "asleep"
"""Gate holder while the replicas sleep."""
NOT_TRAINING = {ASLEEP, "publish"}
"""Holders that are not a training step: a publish pauses the engine itself and must find it awake."""


class EngineSleep:
    def __init__(self, holds: GenerationHolds, replicas: ReplicaSet, *, interval_s: float = 0.05) -> None:
        self.holds = holds
        self.replicas = replicas
        self.interval_s = interval_s
        self.asleep = False
        self.cycles = 0
        """Sleep-and-wake cycles completed (shown with the replicas' state)."""
        self._lock = asyncio.Lock()
        self._kept_awake = 0
        """Publishes in progress (`awake`): the engine does not sleep under them."""

    def _training(self) -> bool:
        return any(holder not in NOT_TRAINING for holder in self.holds.holders)

    def _idle(self) -> bool:
        return not any(self.replicas.router.outstanding)

    async def run(self) -> None:
        """Follow the holds until cancelled; a failed sleep leaves the engine awake and serving."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if self._training() and not self.asleep and not self._kept_awake and self._idle():
                    await self.sleep()
                elif not self._training() and self.asleep:
                    await self.wake()
            except Exception as exc:  # the engine stays as it is; the next round tries again
                log.error("vLLM sleep mode: %s", exc)

    async def sleep(self) -> None:
        async with self._lock:
            if self.asleep or self._kept_awake:
                return
            self.holds.hold(ASLEEP)  # before the first replica sleeps: the training hold may end meanwhile
            self.asleep = True
            try:
                await asyncio.gather(*(vllm_sleep.sleep(r.url) for r in self.replicas.replicas))
            except BaseException:
                await self._wake_all()
                raise
            log.info("vLLM asleep while the trainer steps (%d replicas)", len(self.replicas.replicas))

    async def wake(self) -> None:
        """Wake every replica if asleep (a publish calls this first); the `asleep` hold ends once all wake."""
        async with self._lock:
            if self.asleep:
                await self._wake_all()
                self.cycles += 1
                log.info("vLLM awake again")

    @asynccontextmanager
    async def awake(self) -> AsyncIterator[None]:
        """Wake every replica and keep them awake until the block ends (a publish, its probe included)."""
        self._kept_awake += 1
        try:
            await self.wake()
            yield
        finally:
            self._kept_awake -= 1

    async def _wake_all(self) -> None:
        try:
            await asyncio.gather(*(vllm_sleep.wake_up(r.url) for r in self.replicas.replicas))
        finally:
            # An engine that failed to wake fails its calls with the engine's error, which the health
            # check then takes out of routing; holding every agent forever would be worse.
            self.asleep = False
            self.holds.release(ASLEEP)
