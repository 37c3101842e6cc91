"""The processes under test: the upstream (the fixed one, vLLM, or one already running) and the gateways
in front of it, each started fresh and health-checked before any load is sent."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson

from bench.common import OUT_DIR, ServerProcess, free_port, python_cmd
from bench.gateway_overhead.fixed_answer import answer_in_model_tokens
from bench.gateway_overhead.workload import MODEL_NAME

UPSTREAMS = ("fixed", "vllm")


class Upstream(Protocol):
    """What a run needs of an upstream: where it listens, its process (for CPU, when this run started it)
    and how to stop it. `VLLMServer`, `ServerProcess` and `ExternalUpstream` all fit."""

    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


@dataclass
class ExternalUpstream:
    """An upstream this run did not start (`--upstream-url`): not measured for CPU, not stopped."""

    url: str
    process: None = None

    def stop(self) -> None:
        pass


def upstream_pgid(upstream: Upstream) -> int | None:
    """The process group whose CPU the report charges to the upstream; None for an external one."""
    process = getattr(upstream, "process", None)
    return None if process is None else int(process.pid)


def start_upstream(kind: str, model_dir: Path, *, url: str | None = None, max_tokens: int = 16,
                   workers: int = 1) -> Upstream:
    """The server at `url` when given; else a fresh vLLM on the model, or the fixed upstream answering
    `max_tokens` of the model's own tokens with `workers` uvicorn processes."""
    if url:
        return ExternalUpstream(url.rstrip("/").removesuffix("/v1"))
    if kind == "vllm":
        from tracetrain.engines.vllm_server import VLLMServer

        server = VLLMServer(
            model_dir, served_model_name=MODEL_NAME, max_model_len=4096, log_path=OUT_DIR / "vllm.log",
            listen="tcp",  # the direct arm sends HTTP to it by host and port
        )
        return server.start()
    answer = orjson.dumps(answer_in_model_tokens(model_dir, max_tokens)).decode()
    port = free_port()
    cmd = python_cmd("-m", "bench.gateway_overhead.fixed_upstream", "--port", str(port), "--workers", str(workers),
                     "--answer-json", answer)
    return ServerProcess("fixed_upstream", cmd, f"http://127.0.0.1:{port}").start()


def start_gateway(upstream_url: str, model_dir: Path, db_url: str, env: dict[str, str], src: Path | None,
                  workers: int = 1) -> ServerProcess:
    """`tracetrain serve` in front of the upstream, from the source tree `src` when given; with several
    workers, returned once each of them listens."""
    port = free_port()
    options = {
        "--engine": "vllm",
        "--engine-url": upstream_url,
        "--model": str(model_dir),
        "--served-model-name": MODEL_NAME,
        "--db-url": db_url,
        "--port": str(port),
        "--workers": str(workers),
    }
    cmd = python_cmd("-m", "tracetrain.cli", "serve", *[x for pair in options.items() for x in pair])
    if src is not None:
        inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(src), inherited) if p)}
    server = ServerProcess("gateway", cmd, f"http://127.0.0.1:{port}", env=env, cwd=src).start(timeout=120)
    if workers > 1:
        wait_for_listeners(port, workers)
    return server


def port_of(server: ServerProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


def wait_for_listeners(port: int, n: int, timeout_s: float = 120) -> None:
    """Until `n` processes listen on `port`. /health answers once the first worker listens; a connection
    opened before the others do stays on the workers already up, so a measurement would not use them all."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        pids = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        if len(pids) >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} of {n} gateway workers listening after {timeout_s:.0f} s")
        time.sleep(0.2)


def commit_of(src: Path) -> str:
    """` (commit abc…)` when the source tree carries a `COMMIT` file, as `git archive` snapshots here do."""
    marker = src / "COMMIT"
    return f" (commit {marker.read_text().strip()[:12]})" if marker.exists() else ""
