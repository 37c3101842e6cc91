"""When the policies listing adds a sentence about stale sessions, and when it stays quiet."""

from __future__ import annotations

from tracetrain.proxy.hints import stale_hint


def test_no_hint_while_stale_sessions_are_a_small_share() -> None:
    assert stale_hint({"stale": 40}, 200, max_staleness=1, batch_sessions=32) is None  # 17% of 240
    assert stale_hint({"stale": 20}, 0, max_staleness=1, batch_sessions=32) is None  # not a batch yet
    assert stale_hint({"zero_variance": 400}, 0, max_staleness=1, batch_sessions=32) is None
    assert stale_hint({"stale": 80}, 200, max_staleness=4, batch_sessions=32) is not None  # 29%
