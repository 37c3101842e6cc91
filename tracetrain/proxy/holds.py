"""Generation holds: new generations wait while any holder holds generation.

Holders are a `sync`-mode training step (in the gateway process, or a separate trainer over HTTP,
whose hold is kept in the store so that every gateway process on it obeys) and a publisher that
pauses the engine for an in-place weight reload. A count of holders, not one flag, so that a reload
finishing inside a training step does not reopen generation early. A holder that may die while
holding (a remote trainer) gives a time-to-live, after which the hold lapses by itself rather than
stall every agent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)


class GenerationHolds:
    """Use from the event loop's thread (other threads: `loop.call_soon_threadsafe`)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._holders: dict[str, asyncio.TimerHandle | None] = {}
        self._changed: dict[str, float] = {}
        """When each holder last placed or released its hold (monotonic clock), for `changed_since`."""

    @property
    def holders(self) -> list[str]:
        return sorted(self._holders)

    def is_free(self) -> bool:
        return not self._holders

    async def wait(self) -> None:
        await self._open.wait()

    def hold(self, holder: str, ttl_s: float | None = None) -> None:
        """Hold generation for `holder` (again: the time-to-live restarts)."""
        timer = self._holders.pop(holder, None)
        if timer is not None:
            timer.cancel()
        expiry = asyncio.get_running_loop().call_later(ttl_s, self.release, holder) if ttl_s else None
        self._holders[holder] = expiry
        self._changed[holder] = time.monotonic()
        self._open.clear()

    def release(self, holder: str) -> None:
        """Release `holder`'s hold; generation resumes when no holder is left. Unknown holders: no-op."""
        timer = self._holders.pop(holder, None)
        if timer is not None:
            timer.cancel()
        self._changed[holder] = time.monotonic()
        if not self._holders:
            self._open.set()

    def changed_since(self, holder: str, since: float) -> bool:
        """Whether `holder` placed or released its hold after `since` (monotonic clock)."""
        return self._changed.get(holder, -math.inf) > since

    def hold_for_training(self, training: bool) -> None:
        """A `sync`-mode step in this process: closed while it trains (the trainer's `hold`)."""
        (self.hold if training else self.release)("train")


REMOTE = "remote:"
"""Holders that mirror a hold in the store (a trainer's, placed through any gateway process)."""


async def mirror_store_holds(holds: GenerationHolds, read_holders: Callable[[], Awaitable[Sequence[str]]],
                             interval_s: float = 0.25) -> None:
    """Keep this process's generation held exactly while the store has live holds, so that a hold placed
    through one gateway process (or lapsing there) reaches every process on the same store within
    `interval_s`. Runs until cancelled; a failed read keeps the holds as they are and tries again."""
    while True:
        began = time.monotonic()
        try:
            stored = {REMOTE + holder for holder in await read_holders()}
        except Exception as exc:  # the store restarting: keep the last known state
            log.warning("reading generation holds failed: %s", exc)
        else:
            local = {h for h in holds.holders if h.startswith(REMOTE)}
            # A hold placed or released through this process while the read ran is newer than what the
            # read saw: leave it until the next read, which sees it too.
            for holder in stored - local:
                if not holds.changed_since(holder, began):
                    holds.hold(holder)
            for holder in local - stored:
                if not holds.changed_since(holder, began):
                    holds.release(holder)
        await asyncio.sleep(interval_s)
