"""Running the trainer next to the gateway (`serve --train`) or as its own process (`tracetrain train`)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tracetrain.config import DEFAULT_POLICY, TrainConfig
from tracetrain.engines.publishing import Checkpoint, WeightSource

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine as DBEngine

log = logging.getLogger(__name__)


class TrainerThread:
    """The trainer in a thread of the gateway process. It publishes through `publish` (the gateway's,
    a coroutine function run on the gateway's event loop) and in `sync` mode holds generation through
    `hold` (called on that loop with True while a step trains, False after)."""

    def __init__(self, cfg: TrainConfig, db: DBEngine, base_dir: Path, *,
                 publish: Callable[[Checkpoint], Coroutine[Any, Any, None]], hold: Callable[[bool], None]) -> None:
        self.cfg = cfg
        self.db = db
        self.base_dir = base_dir
        self.publish_async = publish
        self.hold = hold
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.thread = threading.Thread(target=self._run, args=(loop,), name="tracetrain-trainer", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=10)  # a step in progress is abandoned: checkpoints are atomic

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        from tracetrain.trainer.loop import Trainer

        def publish(version: int, path: Path, kind: str, *, weights: WeightSource | None = None) -> None:
            checkpoint = Checkpoint(version, path, kind, weights=weights)  # type: ignore[arg-type]
            asyncio.run_coroutine_threadsafe(self.publish_async(checkpoint), loop).result(timeout=600)

        def publish_line(line: str, version: int, path: Path) -> None:
            checkpoint = Checkpoint(version, path, "lora", line)
            asyncio.run_coroutine_threadsafe(self.publish_async(checkpoint), loop).result(timeout=600)

        def hold(training: bool) -> None:
            loop.call_soon_threadsafe(self.hold, training)

        try:
            trainer = Trainer(self.cfg, self.db, self.base_dir, publish=publish, publish_line=publish_line,
                              hold=hold if self.cfg.mode == "sync" else None)
            trainer.run(self.stop_event)
        except BaseException as exc:
            self.error = exc
            log.exception("the trainer stopped with an error; the gateway keeps serving")
            raise


def remote_hold(gateway_url: str, admin_key: str | None, *, holder: str, ttl_s: float) -> Callable[[bool], None]:
    """The `sync`-mode hold of a trainer in another process: hold the gateway's generation over HTTP
    while a step runs. The hold lapses after `ttl_s` should this process die mid-step."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    def hold(training: bool) -> None:
        path, body = ("hold", {"holder": holder, "ttl_s": ttl_s}) if training else ("release", {"holder": holder})
        response = httpx.post(f"{gateway_url}/v1/generation/{path}", headers=headers, json=body, timeout=30)
        if response.status_code != 200:
            raise RuntimeError(f"gateway answered {response.status_code} to {path}: {response.text[:500]}")

    return hold


def run_standalone(cfg: TrainConfig, db: DBEngine, base_dir: Path, gateway_url: str | None,
                   admin_key: str | None) -> None:
    """`tracetrain train`: the trainer as its own process, handing checkpoints to the gateway over HTTP."""
    from tracetrain.trainer.loop import Trainer

    def publish(version: int, path: Path, kind: str, policy: str = DEFAULT_POLICY, *,
                weights: WeightSource | None = None) -> None:
        # `weights` cannot cross to another process: the gateway reloads the version from `path`
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        response = httpx.post(f"{gateway_url}/v1/policies", headers=headers, timeout=600,
                              json={"version": version, "checkpoint": str(path.resolve()), "kind": kind,
                                    "policy": policy})
        if response.status_code != 200:
            raise RuntimeError(f"gateway answered {response.status_code}: {response.text[:500]}")

    def publish_line(line: str, version: int, path: Path) -> None:
        publish(version, path, "lora", line)

    hold = None
    if cfg.mode == "sync":
        if gateway_url is None:
            raise ValueError("train.mode=sync needs --gateway-url: the trainer must hold the gateway's generation "
                             "while it steps")
        hold = remote_hold(gateway_url, admin_key, holder=f"trainer-{os.getpid()}", ttl_s=cfg.lease_s)
    stop = threading.Event()
    trainer = Trainer(cfg, db, base_dir, publish=publish if gateway_url else None,
                      publish_line=publish_line if gateway_url else None, hold=hold)
    try:
        trainer.run(stop)
    except KeyboardInterrupt:
        log.info("trainer stopped at version %d", trainer.version)
