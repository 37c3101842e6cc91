"""Plain-language hints beside the figures the policies listing returns, for what the numbers alone do not
explain to someone who did not write the trainer."""

from __future__ import annotations

from collections.abc import Mapping

STALE_SHARE = 0.25
"""A hint once stale sessions are at least this share of what the trainer consumed or set aside as stale."""


def stale_hint(set_aside: Mapping[str, int], trained: int, *, max_staleness: int, batch_sessions: int) -> str | None:
    """Why sessions are piling up as `stale`, and the setting that lets the trainer use them; None while
    stale sessions are fewer than a batch or a small share of the traffic (on-policy training sets a few
    aside by design)."""
    stale = set_aside.get("stale", 0)
    if stale < batch_sessions or stale < STALE_SHARE * (stale + trained):
        return None
    return (f"{stale} finished sessions were set aside as stale, against {trained} trained on: their calls were more "
            f"than train.max_staleness ({max_staleness}) versions older than the trainer when their rewards let it "
            "use them, usually because rewards come late. They stay in the store; raising train.max_staleness to "
            "cover how late rewards come, in versions, lets the trainer learn from them (docs/architecture.md, "
            "\"Late rewards\").")
