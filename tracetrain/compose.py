"""One gateway process, put together from its config: every part of proxy/gateway.py built here and
handed to the `Gateway` whole, with the publisher and the services (the trainer thread) that run with it.

cli.py parses arguments and starts servers; this module wires. It is the one place above both `proxy/`
and `trainer/` (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

from sqlalchemy.engine import Engine as DBEngine

from tracetrain.config import Config, GatewayConfig
from tracetrain.engines.base import Engine
from tracetrain.engines.publishing import CanaryPublisher, Checkpoint, Publisher
from tracetrain.engines.replicas import ReplicaSet
from tracetrain.proxy.admission import Admission
from tracetrain.proxy.auth import KeyRing, fingerprint
from tracetrain.proxy.engine_sleep import EngineSleep
from tracetrain.proxy.gateway import Gateway, Load, Service, read_in_thread
from tracetrain.proxy.holds import GenerationHolds
from tracetrain.proxy.metrics import GatewayMetrics
from tracetrain.proxy.policy_lines import PolicyLines
from tracetrain.proxy.promotion import Canaries
from tracetrain.proxy.publish_control import PublishController
from tracetrain.proxy.redact import Redactors
from tracetrain.proxy.render import ChatRenderer
from tracetrain.proxy.session_directory import SessionDirectory
from tracetrain.redaction.redactor import Redactor
from tracetrain.store.retention import Retention
from tracetrain.store.writer import StoreWriter

Publish = Callable[[Checkpoint], Coroutine[Any, Any, None]]
Hold = Callable[[bool], None]
ServiceFactory = Callable[[Publish, Hold], Service]
"""Builds a service that publishes through the gateway and holds its generation (`TrainerThread`)."""


def build_gateway(config: Config, engine: Engine, tokenizer: Any, db: DBEngine, *,
                  publisher: Publisher | None = None, services: Sequence[ServiceFactory] = ()) -> Gateway:
    load = Load()
    # Alone on the event loop, a commit there costs less than the hop to the writer's thread.
    writer = StoreWriter(db, inline=lambda: load.requests <= 1)
    metrics = GatewayMetrics()
    metrics.queue_depth.set_function(lambda: writer.queue_depth)
    metrics.policy_version.set_function(lambda: engine.version)
    holds = GenerationHolds()
    engine_sleep = (EngineSleep(holds, engine) if config.engine.sleep == "on" and isinstance(engine, ReplicaSet)
                    else None)
    read = functools.partial(read_in_thread, db)
    canaries = Canaries(config.promotion, engine, read=read, write=writer.submit,
                        publisher=cast(CanaryPublisher | None, publisher))
    publishing = PublishController(engine, publisher, writer=writer, read=read, holds=holds, canaries=canaries,
                                   engine_sleep=engine_sleep)
    template = config.gateway.chat_template.read_text() if config.gateway.chat_template else None
    return Gateway(
        config, engine, ChatRenderer(tokenizer, template=template), db,
        writer=writer, sessions=SessionDirectory(db, inline_reads=db.dialect.name == "sqlite"),
        publishing=publishing, admission=Admission(config, db, metrics), holds=holds,
        keys=KeyRing(config.gateway.agent_keys(), config.gateway.admin_key,
                     untrained=config.gateway.untrained_keys(), policies=config.gateway.policy_by_key()),
        policies=PolicyLines(db, config),
        metrics=metrics, redactors=redactors(config.gateway), load=load, retention=retention_rules(config),
        engine_sleep=engine_sleep,
        services=[make(publishing.publish, holds.hold_for_training) for make in services])


def retention_rules(config: Config) -> Retention:
    """`store.retention_days`, with the keys' own by fingerprint (a session's `owner`). The policies' own are
    read from the store at each purge (`Retention.with_policies`), since policies can be created at run time."""
    return Retention(config.store.retention_days, {
        fingerprint(key): days for key, days in config.gateway.retention_by_key().items()})


def redactors(config: GatewayConfig) -> Redactors:
    """The gateway's redactor and one per key with a mode of its own, built once: each compiles every
    detector's pattern."""
    by_mode = {mode: Redactor(mode, config.redaction_patterns)
               for mode in {config.redaction, *config.redaction_by_key().values()}}
    return Redactors(by_mode[config.redaction],
                     {fingerprint(key): by_mode[mode] for key, mode in config.redaction_by_key().items()})


def trainer_service(config: Config, db: DBEngine, model_dir: Any) -> ServiceFactory:
    """The trainer in a thread of the gateway process (`serve --train`)."""
    from tracetrain.trainer.service import TrainerThread

    return lambda publish, hold: TrainerThread(config.train, db, model_dir, publish=publish, hold=hold)
