"""The learning-speed bench's arm clock: evaluations are off it, everything else is on it."""

from __future__ import annotations

import time

from bench.learning_speed_report import ArmClock


def test_the_clock_stands_still_while_paused_and_runs_on_after() -> None:
    clock = ArmClock(t0=time.time() - 10.0)  # started 10 s ago, as a child's clock started by its parent
    assert 10.0 <= clock() < 11.0
    with clock.paused():
        during = clock()
        time.sleep(0.2)
        assert clock() == during  # an evaluation's own time is not charged
    after = clock()
    assert during <= after < during + 0.1 and clock.excluded >= 0.2
    time.sleep(0.05)
    assert clock() >= after + 0.05  # training time after it is


def test_the_clock_charges_nothing_for_a_pause_even_when_the_block_raises() -> None:
    clock = ArmClock()
    try:
        with clock.paused():
            time.sleep(0.1)
            raise RuntimeError("the evaluation failed")
    except RuntimeError:
        pass
    assert clock() < 0.05 and clock.excluded >= 0.1
