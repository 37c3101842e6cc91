"""Starts and stops a vLLM OpenAI server as a child process.

vLLM lives in its own Python environment (its transformers pin conflicts with ours), so it runs as
`<that python> -m vllm.entrypoints.openai.api_server` and we only talk HTTP to it. The server runs in
its own process group: vLLM spawns an engine-core and a worker process, and `stop()` must take
all of them down, not just the API server.

By default the server listens on a Unix socket in a directory only this user may enter, not on a TCP
port: it runs with its development endpoints on (`/pause`, `/collective_rpc`, runtime LoRA loading),
which vLLM's `--api-key` does not guard (it covers `/v1` and a few other prefixes only), so on a TCP
port any local process could pause it or load weights into it. Such a server's URL is
`unix:/path/to/socket` (vLLM's own notation); `engine_address` turns either form into what an HTTP
client needs, for every client that talks to vLLM.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]

UNIX_PREFIX = "unix:"
"""Engine URLs of this form name a Unix socket: `unix:/path/to/socket`."""

Listen = Literal["socket", "tcp"]

_SOCKET_HOST = "http://localhost"
"""Request URLs to a socket still need a scheme and host; vLLM ignores the host."""

_MAX_SOCKET_PATH = 107
"""Linux's limit on a Unix socket path (108 bytes with the terminating NUL)."""


@dataclass(frozen=True)
class EngineAddress:
    """Where a vLLM server is reached: the one place engine URLs are parsed."""

    url: str
    """The URL as shown in logs and `/v1/replicas`: `http://host:port` or `unix:/path`."""
    http_base: str
    """What request URLs start with (`{http_base}/v1/completions`)."""
    uds: str | None = None
    """The Unix socket to connect to, when the server listens on one."""


def engine_address(url: str) -> EngineAddress:
    """`http(s)://host:port` (a trailing `/v1` is accepted) or `unix:/absolute/socket/path`; anything
    else is a ValueError, so a config with a mistyped URL fails when it loads."""
    url = url.strip()
    if url.startswith(UNIX_PREFIX):
        path = url.removeprefix(UNIX_PREFIX)
        if not path.startswith("/"):
            raise ValueError(f"engine URL {url!r}: a Unix socket needs an absolute path (unix:/path/to/socket)")
        return EngineAddress(url, _SOCKET_HOST, path)
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"engine URL {url!r}: expected http://host:port or unix:/path/to/socket")
    base = url.rstrip("/").removesuffix("/v1")
    return EngineAddress(base, base)


def http_client(url: str, *, timeout: float, **kwargs: Any) -> httpx.Client:
    """A synchronous httpx client for the vLLM server at `url`, over its socket when it has one;
    request paths are relative (`client.get("/health")`)."""
    address = engine_address(url)
    if address.uds is None:
        return httpx.Client(base_url=address.http_base, timeout=timeout, **kwargs)
    limits = kwargs.pop("limits", httpx.Limits())  # a given transport ignores the client's limits
    return httpx.Client(base_url=address.http_base, timeout=timeout,
                        transport=httpx.HTTPTransport(uds=address.uds, limits=limits), **kwargs)


def async_http_client(url: str, *, timeout: float, **kwargs: Any) -> httpx.AsyncClient:
    """`http_client`, asynchronous."""
    address = engine_address(url)
    if address.uds is None:
        return httpx.AsyncClient(base_url=address.http_base, timeout=timeout, **kwargs)
    limits = kwargs.pop("limits", httpx.Limits())
    return httpx.AsyncClient(base_url=address.http_base, timeout=timeout,
                             transport=httpx.AsyncHTTPTransport(uds=address.uds, limits=limits), **kwargs)


def private_socket_path(name: str = "vllm.sock") -> Path:
    """A socket path inside a new directory only this user may enter (mode 0700, from `mkdtemp`):
    connecting to a Unix socket needs search permission on its directory, so other local users cannot
    reach the server whatever mode vLLM's umask gives the socket file itself."""
    directory = Path(tempfile.mkdtemp(prefix="tracetrain-vllm-"))
    path = directory / name
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"the socket path {path} is longer than a Unix socket path may be; "
                           "set TMPDIR to a shorter directory")
    return path


def replica_placement(index: int, count: int, gpu: str | None = None, *, every_core: bool = False) -> dict[str, str]:
    """Environment that gives replica `index` of `count` servers on this machine its own devices: the
    GPU `gpu` (a `CUDA_VISIBLE_DEVICES` entry, engines/gpus.py), and on CPU builds its own share of
    this process's cores. Without it every CPU replica's OpenMP threads bind to the same cores (vLLM's
    automatic binding picks the same ones in each process), and on a 2-core machine one replica stalled
    for a whole minute while the other ran. One server on the CPU keeps vLLM's own binding (every core but
    one, left to its API process), or with `every_core` computes on all of this process's cores
    (`engine.cpu_cores: all`)."""
    env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}
    cores = sorted(os.sched_getaffinity(0))
    if count <= 1:
        if every_core and gpu is None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
        return env
    share = max(1, len(cores) // count)
    mine = cores[index * share:(index + 1) * share] or cores[index % len(cores):][:1]
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in mine)
    return env


def find_vllm_python() -> str | None:
    """The interpreter that can `import vllm`: `TRACETRAIN_VLLM_PYTHON` if set, else the repo's
    `.venv-vllm`, else this interpreter when vLLM happens to be installed in it (GPU machines)."""
    explicit = os.environ.get("TRACETRAIN_VLLM_PYTHON")
    if explicit:
        return explicit
    local = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return str(local)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the process that started it dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start_child(cpus: set[int] | None) -> None:
    """In the server's process, before vLLM runs: `die_with_parent`, and the CPUs its starter had when
    the server was made (a gateway pinned since, `gateway.cpus`, would otherwise pass its own on)."""
    die_with_parent()
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VLLMServer:
    """One vLLM server process. Use as a context manager, or call `start()` and `stop()`.

    `listen="socket"` (default): the server listens on a Unix socket in a private directory (see the
    module's docstring) and `url` is `unix:/…/vllm.sock`; the path stays the same across restarts, and
    the directory is removed when this object is collected or the interpreter exits. `listen="tcp"`:
    on `host:port`, reachable by every local process, for a server that others must reach by address.

    On CPU, `kv_cache_gib` sets `VLLM_CPU_KVCACHE_SPACE`: vLLM otherwise sizes the KV cache from a
    fraction of all RAM, and an explicit size also lets it skip a warm-up pass at start. SmolLM2-135M
    needs about 46 KB per token, so 2 GiB holds about 46k tokens. `block_size`: tokens per KV-cache block
    (`--block-size`; None: vLLM's default), the unit its prefix cache reuses (`engine.block_size`).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        listen: Listen = "socket",
        python: str | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_gib: int = 2,
        block_size: int | None = None,
        enforce_eager: bool = True,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 3,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self.model = str(model)
        self.model_name = served_model_name or Path(self.model).name
        self.host = host
        self.listen = listen
        self.socket_path: Path | None = None
        """The server's Unix socket (with `listen="socket"`)."""
        if listen == "socket":
            self.socket_path = private_socket_path()
            weakref.finalize(self, shutil.rmtree, self.socket_path.parent, ignore_errors=True)
            self.port = 0
        else:
            self.port = port or free_port(host)
        self.python = python or find_vllm_python()
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.block_size = block_size
        self.enforce_eager = enforce_eager
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        default_log = (f"{self.socket_path.parent.name}.log" if self.socket_path is not None
                       else f"vllm-{self.port}.log")
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / default_log
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    @property
    def url(self) -> str:
        """`unix:/path/to/socket`, or `http://host:port` with `listen="tcp"`: what `engine_address`,
        `VLLMEngine` and `--engine-url` take."""
        if self.socket_path is not None:
            return f"{UNIX_PREFIX}{self.socket_path}"
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        if not self.python:
            raise RuntimeError(
                "vLLM is not installed: create .venv-vllm (bash scripts/setup.sh, docs/operations.md) or set "
                "TRACETRAIN_VLLM_PYTHON"
            )
        # With --uds vLLM binds only the socket: it ignores --host and --port.
        where = (["--uds", str(self.socket_path)] if self.socket_path is not None
                 else ["--host", self.host, "--port", str(self.port)])
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.model_name, *where, "--dtype", self.dtype]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        # No structured-output flags: the engine bounds whitespace per request (`json_constraint` in
        # engines/vllm.py), so this server is configured as one a user starts by hand.
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.block_size:
            cmd += ["--block-size", str(self.block_size)]
        if self.enable_lora:
            cmd += self._lora_args()
        return cmd + self.extra_args

    def _lora_args(self) -> list[str]:
        """Runtime-loadable adapters (`/v1/load_lora_adapter`). `max_loras` is how many adapters one
        batch may mix: at least 2, so requests still running on the previous version share batches
        with the new one. The CPU cache holds as many (vLLM's default); an adapter evicted from it
        while a request still uses it is reloaded from its path, so keep recent checkpoints on disk.
        vLLM accepts ranks 1, 8, 16, 32, 64, 128, 256, 320, 512 only."""
        return ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
                "--max-loras", str(self.max_loras)]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc for in-place weight reload
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),  # ignored by GPU builds
            "PYTHONUNBUFFERED": "1",
        })
        if self.socket_path is not None:
            # vLLM's own processes (API server, engine core, workers) talk over ZeroMQ sockets named
            # `$VLLM_RPC_BASE_PATH/<uuid>`, by default in the shared temporary directory where anyone can
            # list them; the engine core takes requests and utility calls on them. In the private
            # directory they are out of reach as well.
            env["VLLM_RPC_BASE_PATH"] = str(self.socket_path.parent)
        env.update(self.extra_env)
        return env

    def start(self) -> VLLMServer:
        """Launches the server and blocks until `/health` answers 200 (on a small CPU, the better part of
        `startup_timeout`'s first minutes)."""
        self.launch()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def exited(self) -> bool:
        """True once a launched server's process has ended (it was killed or crashed)."""
        return self.process is not None and self.process.poll() is not None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def launch(self) -> None:
        """Starts the server process without waiting for it (a replica set polls `/health` itself).
        A process that already exited is reaped first, so this also restarts a dead server."""
        if self.process is not None and self.process.poll() is not None:
            self.stop()  # takes down whatever of its process group survived
        cmd = self.command()
        if self.socket_path is not None:
            # A killed server leaves its socket file behind, and vLLM's bind fails on an existing path.
            # The directory is ours alone, so whatever is there is a previous server's.
            self.socket_path.unlink(missing_ok=True)
        elif not _port_free(self.host, self.port):
            raise RuntimeError(f"port {self.port} on {self.host} is taken: another vLLM (or anything else) "
                               "is there; pick another port or pass its URL as engine.urls (--engine-url)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM on %s (log: %s): %s", self.url, self.log_path, " ".join(cmd))
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), start_new_session=True, preexec_fn=functools.partial(_start_child, self._cpus),
            )

    def wait_healthy(self) -> None:
        assert self.process is not None
        started = time.monotonic()
        next_report = started + 10
        with http_client(self.url, timeout=2.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"vLLM exited with code {self.process.returncode} during start-up; "
                        f"last log lines:\n{self.log_tail()}"
                    )
                try:
                    if client.get("/health").status_code == 200:
                        log.info("vLLM healthy on %s after %.0f s", self.url, time.monotonic() - started)
                        return
                except httpx.HTTPError:
                    pass
                now = time.monotonic()
                if now - started > self.startup_timeout:
                    raise TimeoutError(
                        f"vLLM not healthy after {self.startup_timeout:.0f} s; last log lines:\n{self.log_tail()}"
                    )
                if now >= next_report:
                    log.info("waiting for vLLM on %s (%.0f s): %s", self.url, now - started, self.log_tail(1))
                    next_report = now + 10
                time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace` seconds. The socket's
        directory stays (a later `start()` uses the same path); it goes with this object."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            self._end(process, grace)
        finally:
            if self.socket_path is not None:
                self.socket_path.unlink(missing_ok=True)

    @staticmethod
    def _end(process: subprocess.Popen[bytes], grace: float) -> None:
        pgid = process.pid  # start_new_session made the server its group leader
        if process.poll() is not None:
            with contextlib.suppress(ProcessLookupError):  # its engine core may outlive a killed server
                os.killpg(pgid, signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("vLLM did not stop within %.0f s; killing it", grace)
        with contextlib.suppress(ProcessLookupError):  # the engine core and workers may outlive it
            os.killpg(pgid, signal.SIGKILL)
        process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
