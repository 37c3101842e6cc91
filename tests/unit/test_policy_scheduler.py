"""The trainer's choice of which named policy steps next (trainer/scheduler.py): fair turns among the lines
with a batch ready, so a busy policy cannot starve a quiet one."""

from __future__ import annotations

from tracetrain.trainer.scheduler import Demand, FairScheduler


def _full(ready: int, batch: int = 4, minimum: int = 4, fill_timeout_s: float = 30.0) -> Demand:
    return Demand(ready, batch, minimum, fill_timeout_s)


def test_a_line_with_no_full_batch_is_not_due() -> None:
    scheduler = FairScheduler()
    assert scheduler.due({"a": _full(3), "b": _full(0)}, now=0.0) == []
    assert scheduler.due({"a": _full(4), "b": _full(0)}, now=0.0) == ["a"]


def test_lines_never_stepped_go_first_then_the_least_recently_stepped() -> None:
    scheduler = FairScheduler()
    everyone = {"a": _full(8), "b": _full(8), "c": _full(8)}
    assert scheduler.due(everyone, now=0.0) == ["a", "b", "c"], "ties by name: the same order every time"
    scheduler.stepped("b")
    assert scheduler.due(everyone, now=0.0) == ["a", "c", "b"]
    scheduler.stepped("a")
    scheduler.stepped("c")
    assert scheduler.due(everyone, now=0.0) == ["b", "a", "c"]


def test_a_busy_line_always_ready_cannot_starve_a_quiet_one() -> None:
    """The busy line has a batch ready at every turn; the quiet one every tenth. Whenever the quiet one is due
    it steps within one turn, and the busy one takes every turn the quiet one does not need."""
    scheduler = FairScheduler()
    taken = []
    waited = []
    quiet_ready_since: int | None = None
    for turn in range(100):
        quiet = 4 if turn % 10 == 0 or quiet_ready_since is not None else 0
        if quiet and quiet_ready_since is None:
            quiet_ready_since = turn
        line = scheduler.due({"busy": _full(40), "quiet": _full(quiet)}, now=float(turn))[0]
        scheduler.stepped(line)
        taken.append(line)
        if line == "quiet":
            assert quiet_ready_since is not None
            waited.append(turn - quiet_ready_since)
            quiet_ready_since = None
    assert taken.count("quiet") == 10 and taken.count("busy") == 90
    assert max(waited) <= 1


def test_a_partial_batch_is_due_after_the_fill_timeout() -> None:
    scheduler = FairScheduler()
    partial = {"a": _full(2, batch=4, minimum=2, fill_timeout_s=5.0)}
    assert scheduler.due(partial, now=100.0) == []
    assert scheduler.due(partial, now=104.0) == []
    assert scheduler.due(partial, now=105.0) == ["a"]
    scheduler.stepped("a")
    assert scheduler.due(partial, now=106.0) == [], "its wait starts again after a step"
    assert scheduler.due({"a": _full(1, batch=4, minimum=2)}, now=200.0) == []
    assert scheduler.due(partial, now=201.0) == [], "fewer than min_sessions in between restarts the wait"
