"""Whether new generations may start: closed while any holder holds it.

Holders are a `sync`-mode training step (in the gateway process, or a separate trainer over HTTP)
and a publisher that pauses the engine for an in-place weight reload. A count of holders, not one
flag, so that a reload finishing inside a training step does not reopen generation early. A holder
that may die while holding (a remote trainer) gives a time-to-live, after which the gate reopens by
itself rather than stall every agent.
"""

from __future__ import annotations

import asyncio


class GenerationGate:
    """Use from the event loop's thread (other threads: `loop.call_soon_threadsafe`)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._holders: dict[str, asyncio.TimerHandle | None] = {}

    @property
    def holders(self) -> list[str]:
        return sorted(self._holders)

    def is_open(self) -> bool:
        return not self._holders

    async def wait(self) -> None:
        await self._open.wait()

    def close(self, holder: str, ttl_s: float | None = None) -> None:
        """Hold the gate for `holder` (again: the time-to-live restarts)."""
        timer = self._holders.pop(holder, None)
        if timer is not None:
            timer.cancel()
        expiry = asyncio.get_running_loop().call_later(ttl_s, self.open, holder) if ttl_s else None
        self._holders[holder] = expiry
        self._open.clear()

    def open(self, holder: str) -> None:
        """Release `holder`'s hold; generation resumes when no holder is left. Unknown holders: no-op."""
        timer = self._holders.pop(holder, None)
        if timer is not None:
            timer.cancel()
        if not self._holders:
            self._open.set()
