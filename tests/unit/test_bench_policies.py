"""bench/policy_serving.py's pure pieces: the order its serving arms run in, and how a publish's window is read off
the calls recorded around it."""

from __future__ import annotations

import pytest

from tests.support.setup_steps import PEFT_MISSING

pytest.importorskip("peft", reason=PEFT_MISSING)  # the benchmark module writes adapters with it

from bench.policy_serving import CallRecord, PublishEvent, interleaved, windows  # noqa: E402


def test_arms_run_in_rounds_every_other_one_reversed() -> None:
    assert interleaved([1, 2, 4, 8], 3) == [1, 2, 4, 8, 8, 4, 2, 1, 1, 2, 4, 8]
    assert interleaved([0, 1], 1) == [0, 1]


def _call(policy: str, start: float, end: float, version: int = 1, status: int = 200,
          chunks: tuple[float, ...] = ()) -> CallRecord:
    return CallRecord(policy, start, end, status, version, len(chunks), chunks)


def test_a_publish_window_compares_the_other_policies_traffic_before_it_with_that_during_it() -> None:
    records = [
        _call("a", 0.0, 1.0, chunks=(0.5, 0.7, 1.0)),  # answered before the publish (from 2 to 3)
        _call("b", 0.5, 1.9, chunks=(1.0, 1.9)),
        _call("a", 1.5, 2.5, chunks=(1.8, 2.5)),  # in flight during it, answered during it
        _call("b", 2.8, 4.0, chunks=(2.9, 4.0)),  # in flight during it, answered after
        _call("a", 3.5, 4.5),  # after it: in neither window
        _call("c", 1.0, 2.0),  # the published policy: not among the others
        _call("c", 2.2, 3.2),  # sent during the publish: either version may answer
        _call("c", 3.1, 4.0, version=2),
        _call("c", 4.1, 5.0, version=2),
        _call("b", 0.0, 2.1, status=502, chunks=(2.05,)),  # failed: in nothing
    ]
    [window] = windows(records, [PublishEvent("c", 2, 2.0, 3.0)], lookback=2.0)
    assert window.before_s == 2.0
    assert sorted(round(x) for x in window.before_ms) == [1000, 1400]
    assert sorted(round(x) for x in window.during_ms) == [1000, 1200]
    assert window.answered_during == 1
    assert window.tokens_per_s_before == pytest.approx(6 / 2)  # 0.5 0.7 1.0 1.0 1.8 1.9
    assert window.tokens_per_s_during == pytest.approx(2 / 1)  # 2.5 and 2.9
    assert window.gap_ms_before == pytest.approx(900)  # 1.0 → 1.9
    assert window.gap_ms_during == pytest.approx(1100)  # 2.9 → 4.0 overlaps the publish
    assert (window.next_version, window.old_after) == (2, 0)
    assert window.publish_s == pytest.approx(1.0)


def test_the_window_before_a_publish_starts_after_the_previous_one_and_old_versions_after_are_counted() -> None:
    records = [_call("a", 0.0, 1.0), _call("a", 1.6, 1.8), _call("b", 2.6, 2.9, version=1),
               _call("b", 3.0, 3.5, version=2)]
    first, second = windows(records, [PublishEvent("c", 2, 1.0, 1.5), PublishEvent("b", 2, 2.0, 2.5)], lookback=10)
    assert second.before_s == pytest.approx(0.5)
    assert [round(x) for x in second.before_ms] == [200]  # not the call before the first publish
    assert (second.next_version, second.old_after) == (1, 1)
    assert first.next_version is None


def test_a_later_version_of_the_same_policy_is_not_counted_as_old() -> None:
    records = [_call("a", 1.0, 1.5, version=2), _call("a", 3.0, 3.5, version=3)]
    first, _ = windows(records, [PublishEvent("a", 2, 0.0, 0.5), PublishEvent("a", 3, 2.0, 2.5)], lookback=10)
    assert (first.next_version, first.old_after) == (2, 0)
