"""Shared pieces of the benchmarks: child server processes, percentiles and result tables."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
OUT_DIR = REPO_ROOT / "bench" / "out"
"""Scratch output (logs, raw profiles); ignored by git."""

console = Console(width=None if sys.stdout.isatty() else 160)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def machine_line() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} · {os.cpu_count()} CPUs · Python {platform.python_version()} · "
        f"load avg {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} · {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )


@dataclass
class ResultTable:
    """Rows kept as strings so the same table prints with rich and writes as Markdown."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    right_align_from: int = 1
    """Columns from this index on are numbers (right-aligned)."""

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def rich(self) -> Table:
        table = Table(title=self.title, title_justify="left")
        for i, name in enumerate(self.columns):
            table.add_column(name, justify="right" if i >= self.right_align_from else "left")
        for row in self.rows:
            table.add_row(*row)
        return table

    def markdown(self) -> str:
        align = ["---:" if i >= self.right_align_from else ":---" for i in range(len(self.columns))]
        lines = [
            f"### {self.title}",
            "",
            "| " + " | ".join(self.columns) + " |",
            "| " + " | ".join(align) + " |",
        ]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def write_results(
    name: str, heading: str, command: str, tables: Sequence[ResultTable], notes: Sequence[str]
) -> Path:
    """Write `bench/results/<name>.md` with the tables and notes, and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.md"
    parts = [f"# {heading}", "", f"`{command}`", "", machine_line(), ""]
    parts += [t.markdown() for t in tables]
    if notes:
        parts += ["", *[f"- {n}" for n in notes]]
    path.write_text("\n".join(parts) + "\n")
    return path


class ServerProcess:
    """A child server in its own process group, with its output in a log file."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        url: str,
        *,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.url = url
        self.health_path = health_path
        self.cwd = cwd or REPO_ROOT
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = OUT_DIR / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 120.0) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the group (a graceful uvicorn shutdown), SIGKILL after `grace` seconds."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]


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
