"""`tracetrain demo`: the gateway in front of vLLM on CPU, an unmodified arithmetic agent talking
through it and posting rewards, and a summary of what the store captured.

Everything runs as separate processes, as it would for a user: `tracetrain serve` (which starts
vLLM), and the agent from examples/agents/arithmetic with nothing but a base URL.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table
from sqlmodel import Session, func, select

from tracetrain.store.db import make_engine
from tracetrain.store.export import export
from tracetrain.store.models import AgentSession, Call, Reward

REPO = Path(__file__).resolve().parent.parent
console = Console()


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 900) -> None:
    started = time.monotonic()
    next_note = started + 15
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the gateway exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > next_note:
            console.print(f"  waiting for the gateway and vLLM to start… {time.monotonic() - started:.0f}s")
            next_note += 15
        time.sleep(1)
    raise SystemExit("the gateway did not become healthy in time")


def _summary(db_url: str) -> Table:
    engine = make_engine(db_url)
    with Session(engine) as db:
        sessions = db.exec(select(func.count()).select_from(AgentSession)).one()
        calls = db.exec(select(func.count()).select_from(Call)).one()
        prompt, completion = db.exec(select(func.sum(Call.prompt_tokens), func.sum(Call.completion_tokens))).one()
        rewards = db.exec(select(func.count(), func.avg(Reward.value))).one()
    table = Table(title="captured by the gateway")
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in [("sessions", sessions), ("calls", calls), ("prompt tokens", prompt or 0),
                        ("sampled tokens", completion or 0), ("rewards", rewards[0]),
                        ("mean reward", f"{rewards[1] or 0:.3f}")]:
        table.add_row(name, str(value))
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tracetrain demo", description=__doc__)
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "transformers"])
    parser.add_argument("--vllm-port", type=int, default=8100)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{(args.out / 'store.db').resolve()}"
    url = f"http://127.0.0.1:{args.port}"
    log = args.out / "gateway.log"
    console.rule("tracetrain demo")
    console.print(f"gateway on {url}, store {db_url}, logs in {log}")
    serve = [sys.executable, "-m", "tracetrain.cli", "serve", "--port", str(args.port), "--db-url", db_url,
             "--engine", args.engine, "--vllm-port", str(args.vllm_port)]
    gateway = subprocess.Popen(serve, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_healthy(url, gateway, log)
        console.print("[green]gateway healthy[/green]; running the arithmetic agent through it")
        agent = REPO / "examples" / "agents" / "arithmetic" / "agent.py"
        subprocess.run([sys.executable, str(agent), "--gateway", url, "--episodes", str(args.episodes)],
                       check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        console.print(_summary(db_url))
        rows = export(make_engine(db_url), args.out / "trajectories.jsonl", "jsonl")
        console.print(f"exported {rows} trajectories to {args.out / 'trajectories.jsonl'}")
        console.print(f"look at one: curl {url}/v1/sessions  (while the gateway runs)")
    finally:
        gateway.terminate()
        try:
            gateway.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gateway.kill()
