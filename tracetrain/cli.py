"""`tracetrain serve` runs the gateway (starting vLLM if asked); `tracetrain export` dumps trajectories."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import ValidationError

from tracetrain.config import Config, EngineConfig, load_config, parse_set, setting_field

log = logging.getLogger("tracetrain")


def _model_dir(config: Config) -> Path:
    if config.engine.model == "smollm2":
        from tracetrain.engines.models import smollm2_dir

        return smollm2_dir()
    return Path(config.engine.model)


def build_engine(config: Config, model_dir: Path, stack: ExitStack) -> Any:
    """The engine of a settled config (`Config.settled`). vLLM is always a replica set (of one, usually):
    it bounds outstanding requests, fails over, and starts a server it started again when that server
    dies."""
    settings = config.engine
    if settings.kind == "transformers":
        from tracetrain.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model_dir, model_name=settings.served_model_name)
    from tracetrain.engines.replicas import Replica, ReplicaSet
    from tracetrain.engines.vllm import VLLMEngine
    from tracetrain.engines.vllm_server import VLLMServer

    started = [] if settings.urls else start_vllm_servers(config, model_dir, stack)
    urls = settings.urls or [server.url for server in started]
    servers: list[VLLMServer | None] = list(started) or [None] * len(urls)
    replicas = [Replica(VLLMEngine(url, model_name=settings.served_model_name, timeout=settings.timeout_s,
                                   json_max_whitespace=settings.json_max_whitespace),
                        server=server) for url, server in zip(urls, servers, strict=True)]
    return ReplicaSet(replicas, spill_at=settings.spill_at, max_outstanding=settings.max_outstanding,
                      queue_wait_s=settings.queue_wait_s, queue_limit=settings.queue_limit,
                      routing=settings.routing)


def start_vllm_servers(config: Config, model_dir: Path, stack: ExitStack) -> list[Any]:
    """`engine.replicas` vLLM servers, stopped with `stack`: each on a Unix socket of its own in a
    private directory (`engine.vllm_listen: socket`), or on ports `engine.vllm_port`, `engine.vllm_port + 1`,
    ... (`tcp`)."""
    from tracetrain.engines.gpus import visible_gpus
    from tracetrain.engines.vllm_server import VLLMServer, replica_placement

    settings = config.engine
    gpus = [visible_gpus()[g] for g in settings.gpus]  # settled by `Config.settled`: one per replica
    transfer_args, transfer_env = transfer_settings(config)
    servers = [VLLMServer(model_dir, port=settings.vllm_port + i, listen=settings.vllm_listen,
                          served_model_name=settings.served_model_name, python=settings.vllm_python,
                          dtype=settings.dtype, block_size=settings.block_size,
                          extra_args=[*gpu_args(settings), *transfer_args, *settings.vllm_args],
                          enable_lora=config.publish_mode() == "lora",
                          max_lora_rank=config.train.lora_rank, max_loras=settings.max_loras,
                          env={**replica_placement(i, settings.replicas, gpus[i] if gpus else None,
                                                  every_core=settings.cpu_cores == "all"), **transfer_env})
               for i in range(settings.replicas)]
    for server in servers:
        stack.callback(server.stop)
    for server in servers:  # all launched first: they load in parallel
        server.launch()
    for server in servers:
        server.wait_healthy()
    return servers


def transfer_settings(config: Config) -> tuple[list[str], dict[str, str]]:
    """vLLM's flags and environment for weights sent from the trainer's memory (`train.weight_transfer`)."""
    if config.train.weight_transfer in ("disk", "auto"):
        return [], {}
    from tracetrain.engines.weight_transfer import server_config

    return server_config(config.train.weight_transfer)


def gpu_args(engine: EngineConfig) -> list[str]:
    """vLLM flags for the GPU plan: its memory share, and sleep mode when it sleeps during sync steps."""
    args = []
    if engine.memory_share is not None:
        args += ["--gpu-memory-utilization", f"{engine.memory_share:g}"]
    if engine.sleep == "on":
        args.append("--enable-sleep-mode")
    return args


def settle(config: Config, *, training_here: bool) -> Config:
    """`config` with every `auto` decided (`Config.settled`), refused with a sentence when the GPU split
    cannot work here."""
    try:
        settled = config.settled(training_here=training_here)
    except ValueError as exc:
        raise SystemExit(f"configuration error: {exc}") from None
    if settled.engine.gpus or settled.train.gpus:
        log.info("GPUs: vLLM replicas on %s (memory share %s%s), trainer on %s", settled.engine.gpus or "none",
                 settled.engine.memory_share, ", sleeps during sync steps" if settled.engine.sleep == "on" else "",
                 settled.train.gpus or "the CPU")
    return settled


def build_publisher(config: Config, engine: Any, model_dir: Path) -> Any:
    """How trained weights reach this engine: in-process swap, or vLLM LoRA load or reload on every
    replica."""
    from tracetrain.engines.probe import ProbeCheck
    from tracetrain.engines.replica_publish import ReplicaPublisher
    from tracetrain.engines.replicas import ReplicaSet
    from tracetrain.engines.transformers_publish import InProcessPublisher
    from tracetrain.engines.vllm_publish import VLLMLoRAPublisher, VLLMReloadPublisher

    mode = config.publish_mode()
    if mode == "none":
        return None
    settings = config.engine
    probe = ProbeCheck(settings.dtype, settings.publish_probe_tolerance) if settings.publish_probe else None
    # Told apart without importing the in-process engine's module: it imports torch, which a gateway in
    # front of vLLM does not need (`pip install tracetrain` alone serves).
    if not isinstance(engine, ReplicaSet):
        return InProcessPublisher(engine)
    engines = [r.engine for r in engine.replicas]
    if mode == "lora":
        return ReplicaPublisher(engine, [VLLMLoRAPublisher(e) for e in engines],
                                canary_share=config.promotion.canary_share, probe=probe)
    transfer = None
    if config.train.weight_transfer not in ("disk", "auto"):
        from tracetrain.engines.weight_transfer import BACKENDS

        transfer = BACKENDS[config.train.weight_transfer]
    return ReplicaPublisher(engine, [VLLMReloadPublisher(e, model_dir, transfer=transfer) for e in engines],
                            canary_share=config.promotion.canary_share, probe=probe)


def serve(config: Config, *, train: bool = False) -> None:
    config.gateway.check_access()  # first: refuse in a second, before importing torch or loading any model
    if config.gateway.workers > 1:
        if train:
            raise SystemExit("configuration error: --train runs the trainer inside the gateway process; with "
                             "--workers > 1 run it as its own process (`tracetrain train --gateway-url …`)")
        serve_workers(config)
        return
    if train and config.gateway.cpus:
        raise SystemExit("configuration error: gateway.cpus with --train would confine the trainer in the "
                         "gateway process to those CPUs; run it as its own process (`tracetrain train`)")
    import uvicorn
    from transformers import AutoTokenizer

    from tracetrain.compose import build_gateway, trainer_service
    from tracetrain.proxy.app import build_app
    from tracetrain.store.db import open_db

    log.info("resolved config:\n%s", json.dumps(_redacted(config), indent=2, default=str))
    model_dir = _model_dir(config)
    # The store first: an out-of-date one is refused before vLLM spends a minute starting.
    db = open_db(config.store.url, sqlite_synchronous=config.store.sqlite_synchronous)
    with ExitStack() as stack:
        engine = build_engine(config, model_dir, stack)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        gateway = build_gateway(config, engine, tokenizer, db, publisher=build_publisher(config, engine, model_dir),
                                services=[trainer_service(config, db, model_dir)] if train else [])
        log.info("gateway on http://%s:%d  (agents: OPENAI_BASE_URL=http://%s:%d/s/<session>/v1)",
                 config.gateway.host, config.gateway.port, config.gateway.host, config.gateway.port)
        if config.gateway.cpus:  # engine.kind: transformers is refused when the config loads
            # Here, after any vLLM server started (a child would inherit the affinity): the event loop's
            # thread, and the store's threads it starts from now on.
            os.sched_setaffinity(0, config.gateway.cpus)
            log.info("gateway pinned to CPU %s", ",".join(map(str, config.gateway.cpus)))
        if train and config.train.uses_fsdp:
            from tracetrain.trainer.fsdp_backend import start_ray

            # Here, in the main thread, and before the handler below: Ray installs its own SIGTERM
            # handler, which would end the process without running the ExitStack.
            start_ray(config.train)
        # uvicorn re-raises SIGTERM after its graceful shutdown; turning it into SystemExit lets the
        # ExitStack stop the vLLM server instead of the process dying and orphaning it.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        uvicorn.run(build_app(gateway), host=config.gateway.host, port=config.gateway.port, **UVICORN_OPTIONS)


UVICORN_OPTIONS: dict[str, Any] = {
    "log_level": "warning", "timeout_graceful_shutdown": 5,
    # Per request, uvicorn formats an access-log line before the logger's level drops it, and its
    # proxy-headers middleware wraps every request; the gateway uses neither (the metrics count requests).
    "access_log": False, "proxy_headers": False,
}

WORKER_CONFIG = "TRACETRAIN_WORKER_CONFIG"
"""The resolved config, as JSON, handed from `serve --workers N` to each worker process."""


def serve_workers(config: Config) -> None:
    """`gateway.workers` worker processes on one port (`proxy/processes.py`). vLLM servers are started here, in the
    supervising process, and restarted here when they die; each worker reaches them by URL and builds
    its own gateway on the shared store (`worker_app`)."""
    import threading

    from tracetrain.proxy.processes import run_workers
    from tracetrain.store.db import open_db

    log.info("resolved config:\n%s", json.dumps(_redacted(config), indent=2, default=str))
    model_dir = _model_dir(config)
    db = open_db(config.store.url)  # an out-of-date store is refused once, here
    with ExitStack() as stack:
        servers = [] if config.engine.urls else start_vllm_servers(config, model_dir, stack)
        urls = config.engine.urls or [server.url for server in servers]
        stop = threading.Event()
        stack.callback(stop.set)
        # Full weights: the workers label each replica with what the store says it holds; a restarted
        # server holds its own model again.
        store = db if config.train.publish != "none" and config.publishes_full_weights() else None
        threading.Thread(target=_restart_dead, args=(servers, stop, store), daemon=True).start()
        # The workers reach the servers started here by URL; a socket travels as `unix:/path`, which
        # the workers run as this user may open (its directory is this user's alone).
        # Each worker is put on its CPU before it starts (processes.py): it does not pin itself again.
        worker_config = config.updated(engine={"urls": urls, "replicas": 1, "kind": "vllm"}, gateway={"cpus": []})
        os.environ[WORKER_CONFIG] = worker_config.model_dump_json()
        log.info("gateway on http://%s:%d with %d worker processes", config.gateway.host, config.gateway.port,
                 config.gateway.workers)
        # SIGTERM stops the workers and returns here; the ExitStack then stops the vLLM servers.
        run_workers("tracetrain.cli:worker_app", workers=config.gateway.workers, cpus=config.gateway.cpus,
                    host=config.gateway.host, port=config.gateway.port, options=UVICORN_OPTIONS)


def _restart_dead(servers: list[Any], stop: Any, store: Any = None) -> None:
    """Start again a vLLM server of ours that died; the workers' replica sets take it back once healthy,
    labelled with version 0 when `store` records full-weight reloads."""
    from sqlmodel import Session

    from tracetrain.engines.vllm_server import engine_address
    from tracetrain.store import replica_states

    while not stop.wait(2.0):
        for server in servers:
            if server.exited:
                log.warning("vLLM on %s exited (%s); starting it again", server.url, server.returncode)
                server.launch()
                if store is not None:
                    try:
                        with Session(store) as db:
                            replica_states.reset(db, url=engine_address(server.url).url)
                            db.commit()
                    except Exception as exc:  # keep restarting servers; the workers keep the old label
                        log.error("recording that %s restarted failed: %s", server.url, exc)


def worker_app() -> Any:
    """One worker process of `serve --workers N`: a gateway over the supervisor's vLLM servers."""
    from transformers import AutoTokenizer

    from tracetrain.compose import build_gateway
    from tracetrain.proxy.app import build_app
    from tracetrain.store.db import open_db

    config = Config.model_validate_json(os.environ[WORKER_CONFIG])
    logging.basicConfig(level=config.gateway.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = _model_dir(config)
    engine = build_engine(config, model_dir, ExitStack())  # by URL: nothing to stop
    gateway = build_gateway(config, engine, AutoTokenizer.from_pretrained(str(model_dir)),
                            open_db(config.store.url, sqlite_synchronous=config.store.sqlite_synchronous),
                            publisher=build_publisher(config, engine, model_dir))
    return build_app(gateway)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _redacted(config: Config) -> dict[str, Any]:
    values = config.model_dump()
    values["gateway"]["api_keys"] = ["***"] * len(config.gateway.api_keys)
    values["gateway"]["admin_key"] = "***" if config.gateway.admin_key else None
    return values


def _check_trainer(config: Config) -> None:
    """Unknown algorithm names and hardware this machine lacks fail now, with a sentence, not after
    vLLM or Ray has started."""
    try:
        from tracetrain.trainer.algorithms.verl_ops import check_names
        from tracetrain.trainer.devices import check_hardware
    except ImportError as exc:
        raise SystemExit(f"training needs the train extra ({exc.name} is missing): pip install 'tracetrain[train]'") \
            from exc
    if config.train.uses_fsdp and importlib.util.find_spec("ray") is None:
        raise SystemExit("configuration error: train.workers > 1 (fsdp) needs Ray: "
                         "pip install 'tracetrain[distributed]'")
    try:
        check_names(config.train)
        check_hardware(config.train)
    except ValueError as exc:
        raise SystemExit(f"configuration error: {exc}") from exc


def train_cmd(args: argparse.Namespace, config: Config) -> None:
    from tracetrain.store.db import open_db
    from tracetrain.trainer.service import run_standalone

    log.info("resolved config:\n%s", json.dumps(_redacted(config), indent=2, default=str))
    run_standalone(config.train, open_db(config.store.url), _model_dir(config), args.gateway_url,
                   config.gateway.admin_key)


def db_cmd(args: argparse.Namespace, config: Config) -> None:
    from tracetrain.store import schema
    from tracetrain.store.db import connect_db

    if args.action == "purge":
        purge_cmd(config)
        return
    db = connect_db(config.store.url)
    if args.action == "current":
        current, has_tables = schema.revision(db)
        found = current or ("tracetrain 0.1 (no revision)" if has_tables else "empty")
        print(f"store schema: {found}; this tracetrain: {schema.head()}")
        return
    try:
        before, after = schema.upgrade(db)
    except schema.StoreOutOfDate as exc:
        raise SystemExit(str(exc)) from exc
    print(f"store schema: {before or 'none'} -> {after}")


def purge_cmd(config: Config) -> None:
    """Clear the content of every session past its retention now, as the gateway does on its schedule."""
    import asyncio

    from sqlmodel import Session

    from tracetrain.compose import retention_rules
    from tracetrain.store import retention
    from tracetrain.store.db import open_db
    from tracetrain.store.writer import StoreWriter

    rules = retention_rules(config)
    db = open_db(config.store.url)  # an out-of-date store is refused
    with Session(db) as s:
        if not retention.anything_expires(s, retention=rules):
            print("nothing to purge: neither store.retention_days nor any key's or policy's retention_days is set")
            return

    async def run() -> int:
        # Through a store writer, as the gateway writes: on SQLite it takes turns with running gateways.
        writer = StoreWriter(db)
        await writer.start()
        try:
            return await retention.purge(writer.submit, db, retention=rules, actor="cli")
        finally:
            await writer.stop()

    print(f"purged the content of {asyncio.run(run())} sessions")


def export_cmd(args: argparse.Namespace, config: Config) -> None:
    from tracetrain.store.db import open_db
    from tracetrain.store.export import export

    rows = export(open_db(config.store.url), Path(args.out), args.format, policy=args.policy)
    print(f"wrote {rows} trajectory segments to {args.out}")


FLAGS: dict[str, str] = {
    "host": "gateway.host", "port": "gateway.port", "engine": "engine.kind", "engine-url": "engine.urls",
    "model": "engine.model", "served-model-name": "engine.served_model_name", "replicas": "engine.replicas",
    "vllm-port": "engine.vllm_port", "db-url": "store.url", "admin-key": "gateway.admin_key",
    "api-key": "gateway.api_keys", "workers": "gateway.workers", "gateway-cpus": "gateway.cpus",
    "retention-days": "store.retention_days",
}
"""The named flags of every subcommand and the setting each one sets; every other setting is
`--set GROUP.NAME=VALUE`."""
SERVE_FLAGS = ("host", "port", "engine", "engine-url", "model", "served-model-name", "replicas", "vllm-port",
               "db-url", "admin-key", "api-key", "workers", "gateway-cpus")
TRAIN_FLAGS = ("db-url", "model", "admin-key")
REPEATED = ("engine-url", "api-key")
"""Flags given once per value (`--engine-url a --engine-url b`)."""


def _help(path: str) -> str:
    """A flag's help: the first sentence of its setting's docstring (docs/configuration.md has it all), and
    the setting's name, for YAML, the environment and `--set`."""
    text = " ".join((setting_field(path).description or "").split())
    first = text.split(". ")[0].rstrip(".")
    return f"{first}. Setting: {path}.".replace("%", "%%")  # argparse formats help with %


def _add_setting_flag(parser: argparse.ArgumentParser, flag: str, note: str = "") -> None:
    """`--flag` for the setting `FLAGS` names, its value stored under the setting's dotted path."""
    path = FLAGS[flag]
    metavar = flag.upper().replace("-", "_")
    if flag in REPEATED:
        parser.add_argument(f"--{flag}", action="append", dest=path, metavar=metavar,
                            help=_help(path) + " Repeatable." + note)
    else:
        annotation = setting_field(path).annotation
        # `int` and `int | None` parse as numbers; anything else (`list[int]` CPU ranges as `0-1`) as text
        # that the setting's own validator reads.
        optional_int = get_origin(annotation) in (Union, UnionType) and int in get_args(annotation)
        kind = int if annotation is int or optional_int else str
        parser.add_argument(f"--{flag}", type=kind, dest=path, metavar=metavar, help=_help(path) + note)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracetrain")
    parser.add_argument("--config", type=Path, help="YAML config file")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="gateway + vLLM + an example agent posting rewards (see tracetrain.demo)")
    serve_p = sub.add_parser("serve", help="run the gateway in front of an engine")
    for flag in SERVE_FLAGS:
        _add_setting_flag(serve_p, flag)
    serve_p.add_argument("--train", action="store_true", help="Run the trainer in the gateway process.")
    train_p = sub.add_parser("train", help="run the trainer as its own process against the same store")
    for flag in TRAIN_FLAGS:
        _add_setting_flag(train_p, flag)
    train_p.add_argument("--gateway-url", help="gateway that publishes each new version (admin key needed)")
    for p in (serve_p, train_p):
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any setting as GROUP.NAME (engine.kind=vllm, gateway.admission=staleness, "
                            "train.lr=1e-4), or a trainer-only name bare (lr=1e-4); repeatable, the same keys in "
                            "every subcommand")
    db_p = sub.add_parser("db", help="the store: `current` shows its schema revision, `upgrade` migrates it, "
                          "`purge` clears the content of sessions past their retention")
    db_p.add_argument("action", choices=["current", "upgrade", "purge"],
                      help="current: the schema revision; upgrade: migrate to this tracetrain's; purge: clear the "
                      "content of sessions older than store.retention_days (keeping their figures)")
    _add_setting_flag(db_p, "db-url")
    _add_setting_flag(db_p, "retention-days", " For purge; default: the config's.")
    export_p = sub.add_parser("export", help="export trajectories to JSONL or Parquet")
    _add_setting_flag(export_p, "db-url")
    export_p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl",
                          help="JSON lines, or Parquet (needs the export extra).")
    export_p.add_argument("--out", required=True, help="File to write the trajectory segments to.")
    export_p.add_argument("--policy", default=None, help="Export only this named policy's sessions.")
    return parser


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags and `--set`, nested by group; a named flag wins over `--set`. A flag left
    out is None here and sets nothing (`--set GROUP.NAME=null` may set a None)."""
    overrides = parse_set(getattr(args, "set", []))
    for key, value in vars(args).items():
        if "." in key and value is not None:
            group, name = key.split(".")
            overrides.setdefault(group, {})[name] = value
    return overrides


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from tracetrain.demo.run import main as demo

        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        demo(argv[1:])
        return
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, **flag_overrides(args))
    except ValidationError as exc:  # a sentence per problem, not a traceback
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in exc.errors())
        raise SystemExit(f"configuration error: {problems}") from None
    logging.basicConfig(level=config.gateway.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise
    training_here = args.command == "train" or (args.command == "serve" and args.train)
    if training_here:
        _check_trainer(config)
    if args.command in ("serve", "train"):
        config = settle(config, training_here=training_here)
    from tracetrain.store.schema import StoreOutOfDate

    try:
        if args.command == "serve":
            serve(config, train=args.train)
        elif args.command == "train":
            train_cmd(args, config)
        elif args.command == "export":
            export_cmd(args, config)
        elif args.command == "db":
            db_cmd(args, config)
    except StoreOutOfDate as exc:  # an older store: say what to run, no traceback
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
