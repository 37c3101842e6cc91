"""Real servers for tests: the gateway over HTTP in a thread, and a throwaway PostgreSQL cluster."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from pydantic import BaseModel
from transformers import AutoTokenizer

from tracetrain.compose import ServiceFactory, build_gateway
from tracetrain.config import Config
from tracetrain.engines.base import Engine
from tracetrain.engines.publishing import Publisher
from tracetrain.proxy.app import build_app
from tracetrain.proxy.gateway import Gateway
from tracetrain.store.db import open_db


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_healthy(process: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 120) -> None:
    """Until the server `process` started answers `url`/health with 200; fails with its log's tail if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} not healthy after {timeout_s:.0f} s"
        time.sleep(0.3)


@dataclass
class RunningGateway:
    url: str
    gateway: Gateway
    server: uvicorn.Server
    thread: threading.Thread

    def v1(self, session: str | None = None, group: str | None = None) -> str:
        base = self.url
        if session:
            base += f"/s/{session}"
            if group:
                base += f"/g/{group}"
        return base + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@functools.cache
def load_tokenizer(tokenizer_dir: Path) -> Any:
    """One tokenizer per model directory for the whole session: most tests start a gateway of their own,
    and loading the tokenizer is most of a start. Sharing it is safe: the gateway only reads it (encode,
    decode, chat template), never changes its settings."""
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def start_gateway(engine: Engine, tokenizer_dir: Path, db_url: str, /, *, publisher: Publisher | None = None,
                  services: Sequence[ServiceFactory] = (), **groups: dict[str, Any] | BaseModel) -> RunningGateway:
    """Serve a real gateway on a free loopback port from a background thread, built as `serve` builds it
    (tracetrain/compose.py), with `publisher` and background `services` (the trainer) if given.

    `groups` are settings by group, merged over the port, store and model name given here:
    `gateway={"api_keys": [...]}`, `promotion={"mode": "canary"}`, `engine={...}` (a keyword, apart from the
    `engine` object passed first), or a whole model (`train=TrainConfig(...)`)."""
    port = free_port()
    settings: dict[str, Any] = {"gateway": {"port": port}, "store": {"url": db_url},
                                "engine": {"served_model_name": engine.model_name}}
    for name, values in groups.items():
        settings[name] = values if isinstance(values, BaseModel) else {**settings.get(name, {}), **values}
    cfg = Config(**settings)
    gateway = build_gateway(cfg, engine, load_tokenizer(tokenizer_dir), open_db(db_url),
                            publisher=publisher, services=services)
    server = uvicorn.Server(uvicorn.Config(build_app(gateway), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.05)
    return RunningGateway(f"http://127.0.0.1:{port}", gateway, server, thread)


class PostgresCluster:
    """initdb + pg_ctl in a temporary directory; as root the server runs as the postgres user.

    By default the cluster runs with fsync=off, which is fast and enough for tests of behaviour.
    `durable=True` gives PostgreSQL's production settings instead (fsync, synchronous_commit and
    full_page_writes on, and initdb syncs its files), for tests about what survives a crash.
    """

    def __init__(self, *, durable: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tt-pg-"))
        self.port = free_port()
        self.durable = durable
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @staticmethod
    def bin(name: str) -> str | None:
        """A PostgreSQL program from PATH, or from Debian's versioned directory (not on PATH)."""
        found = shutil.which(name)
        if found:
            return found
        candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
        return str(candidates[-1]) if candidates else None

    @classmethod
    def available(cls) -> bool:
        return cls.bin("initdb") is not None and cls.bin("pg_ctl") is not None

    def start(self) -> None:
        if self._as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        data = str(self.dir / "data")
        initdb = [str(self.bin("initdb")), "-D", data, "-A", "trust", "-U", "postgres"]
        if self.durable:
            # Set explicitly on the command line, so no postgresql.conf default can weaken them.
            settings = "-c fsync=on -c synchronous_commit=on -c full_page_writes=on"
        else:
            initdb.append("--no-sync")
            settings = "-c fsync=off"
        subprocess.run([*self._as_postgres, *initdb], check=True, capture_output=True)
        subprocess.run([*self._as_postgres, str(self.bin("pg_ctl")), "-D", data, "-w", "-l", str(self.dir / "log"),
                        "-o", f"-p {self.port} -k {self.dir} {settings}", "start"],
                       check=True, capture_output=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        stop = [str(self.bin("pg_ctl")), "-D", str(self.dir / "data"), "-m", "immediate", "stop"]
        subprocess.run([*self._as_postgres, *stop], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
