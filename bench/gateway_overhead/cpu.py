"""CPU meters: user + system seconds of process groups and of their threads, read from /proc.

Reading another process's counters costs the measured process nothing, and CPU per request holds up on
a noisy shared machine where wall-clock rates swing: the report leans on these figures.
"""

from __future__ import annotations

import functools
import os
import resource
from collections.abc import Callable

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> list[bytes]:
    """A /proc stat file's fields after "pid (comm)": state, ppid, pgrp, …, utime (index 11), stime (12)."""
    with open(path, "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if int(_stat(f"{entry.path}/stat")[2]) == pgid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in process group `pgid` (all their threads)."""
    total = 0
    for pid in group_pids(pgid):
        try:
            fields = _stat(f"/proc/{pid}/stat")
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _TICKS


THREAD_CPU_PARTS = ("loop user", "loop sys", "threads user", "threads sys")
"""`thread_cpu_seconds`'s parts: each process's main thread (where the event loop runs) and its other
threads (store writes, reads, executors), user and system time apart."""


def thread_cpu_seconds(pgid: int, part: str) -> float:
    """One of `THREAD_CPU_PARTS` in CPU seconds, over the live processes of process group `pgid`."""
    on_loop, column = part.startswith("loop"), 11 if part.endswith("user") else 12
    total = 0
    for pid in group_pids(pgid):
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                if (task.name == str(pid)) == on_loop:
                    total += int(_stat(f"{task.path}/stat")[column])
        except OSError:
            continue
    return total / _TICKS


def self_cpu_seconds() -> float:
    """This process's user + system CPU (getrusage: microseconds, where os.times counts 10 ms ticks)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


Meter = Callable[[], float]
"""A running total of CPU seconds, read before and after each phase."""


def gateway_meters(gateway_pgids: dict[str, int], upstream_pgid: int | None) -> dict[str, Meter]:
    """Every gateway's process group (by its meter name), the first gateway's split by thread
    (`gateway loop user`, …), this load generator, and the upstream where this run started it."""
    meters: dict[str, Meter] = {meter: functools.partial(group_cpu_seconds, pgid)
                                for meter, pgid in gateway_pgids.items()}
    first = gateway_pgids["gateway"]
    for part in THREAD_CPU_PARTS:
        meters[f"gateway {part}"] = functools.partial(thread_cpu_seconds, first, part)
    meters["loadgen"] = self_cpu_seconds
    if upstream_pgid is not None:
        meters["upstream"] = functools.partial(group_cpu_seconds, upstream_pgid)
    return meters
