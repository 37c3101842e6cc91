"""Several gateway processes on one port, each accepting on a listening socket of its own.

Why not uvicorn's `workers=N`: there the supervisor binds one socket and every worker accepts from
it. A worker woken by a new connection accepts everything waiting (asyncio accepts up to the backlog
per wake-up), so a burst of connections lands on one or two workers, and kept-alive connections stay
there. Measured: 64 connections opened at once to 4 workers went 39 and 25 to two of them and none to
the other two; on a 16-core machine 4 workers then served only 1.35x the requests of one.

Here each worker binds its own socket with SO_REUSEPORT, and the kernel hashes every new connection
to one of the listening sockets: the spread is even whatever the timing. The supervisor keeps a socket
bound to the port (not listening, so it receives nothing) to fail at once when the port is taken and
to hold it while a worker restarts. A worker that dies is started again; one that dies within
`QUICK_EXIT_S` of its start `QUICK_EXITS` times in a row stops the gateway, since it will not start.
Each worker reports once it listens, and the supervisor logs when all of them do: `/health` answers
as soon as the first one listens, and connections opened before the others are up stay with it.
Elsewhere than on Linux (where SO_REUSEPORT does not spread connections, or is missing) uvicorn's own
supervisor runs instead.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

QUICK_EXIT_S = 10.0
QUICK_EXITS = 3
POLL_S = 0.5


def run_workers(factory: str, *, workers: int, host: str, port: int, options: dict[str, Any],
                cpus: list[int] | None = None) -> None:
    """Serve the ASGI app that `factory` ("module:function") builds in `workers` processes until SIGINT
    or SIGTERM; returns once every worker has stopped. With `cpus`, worker i runs on `cpus[i % len]`
    alone (a restarted worker on the same one)."""
    import uvicorn

    if sys.platform != "linux":
        uvicorn.run(factory, factory=True, workers=workers, host=host, port=port, **options)
        return
    reserved = bind_reuseport(host, port)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    spawn = multiprocessing.get_context("spawn")
    listening: Any = spawn.SimpleQueue()

    def start_worker(i: int) -> Any:
        cpu = cpus[i % len(cpus)] if cpus else None
        process = spawn.Process(target=_serve, args=(factory, host, port, options, listening, cpu),
                                name="gateway-worker")
        process.start()
        return process

    processes: list[Any] = []
    try:
        processes = [start_worker(i) for i in range(workers)]
        started = [time.monotonic()] * workers
        quick_exits = [0] * workers
        reported: set[int] = set()
        announced = False
        while not stop.wait(POLL_S):
            while not listening.empty():
                reported.add(listening.get())
            if not announced and {p.pid for p in processes} <= reported:
                log.info("all %d gateway workers listen on %s:%d", workers, host, port)
                announced = True
            for i, process in enumerate(processes):
                if process.is_alive():
                    continue
                quick_exits[i] = quick_exits[i] + 1 if time.monotonic() - started[i] < QUICK_EXIT_S else 0
                if quick_exits[i] >= QUICK_EXITS:
                    raise SystemExit(f"gateway worker exited {QUICK_EXITS} times within {QUICK_EXIT_S:.0f} s of "
                                     f"starting (last exit code {process.exitcode}); see the log above")
                log.warning("gateway worker %s exited with %s; starting another", process.pid, process.exitcode)
                processes[i], started[i], announced = start_worker(i), time.monotonic(), False
    finally:
        _stop_all(processes, grace_s=float(options.get("timeout_graceful_shutdown") or 5) + 5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reserved.close()


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


def _serve(factory: str, host: str, port: int, options: dict[str, Any], listening: Any, cpu: int | None) -> None:
    """One worker: its own listening socket, uvicorn serving the factory's app on it; its pid put on
    `listening` once it accepts. On `cpu` alone when given: set first, so every thread it starts inherits it."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                listening.put(os.getpid())

    config = uvicorn.Config(factory, factory=True, host=host, port=port, **options)
    Server(config).run(sockets=[bind_reuseport(host, port)])


def _stop_all(processes: list[Any], grace_s: float) -> None:
    """SIGTERM to every worker (uvicorn finishes the requests in flight), SIGKILL to any left after
    `grace_s`."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.warning("gateway worker %s did not stop in %.0f s; killing it", process.pid, grace_s)
            process.kill()
            process.join()
