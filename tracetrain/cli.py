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
from typing import Any

from pydantic import ValidationError

from tracetrain.config import Config, load_config, parse_set

log = logging.getLogger("tracetrain")


def _model_dir(config: Config) -> Path:
    if config.model == "smollm2":
        from tracetrain.engines.models import smollm2_dir

        return smollm2_dir()
    return Path(config.model)


def build_engine(config: Config, model_dir: Path, stack: ExitStack) -> Any:
    """The engine of a settled config (`Config.settled`). vLLM is always a replica set (of one, usually):
    it bounds outstanding requests, fails over, and starts a server it started again when that server
    dies."""
    if config.engine == "transformers":
        from tracetrain.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model_dir, model_name=config.served_model_name)
    from tracetrain.engines.replicas import Replica, ReplicaSet
    from tracetrain.engines.vllm import VLLMEngine
    from tracetrain.engines.vllm_server import VLLMServer

    started = [] if config.engine_url else start_vllm_servers(config, model_dir, stack)
    urls = config.engine_url or [server.url for server in started]
    servers: list[VLLMServer | None] = list(started) or [None] * len(urls)
    replicas = [Replica(VLLMEngine(url, model_name=config.served_model_name, timeout=config.engine_timeout_s,
                                   json_max_whitespace=config.json_max_whitespace),
                        server=server) for url, server in zip(urls, servers, strict=True)]
    return ReplicaSet(replicas, spill_at=config.replica_spill_at, max_outstanding=config.replica_max_outstanding,
                      queue_wait_s=config.replica_queue_wait_s, queue_limit=config.replica_queue_limit,
                      routing=config.replica_routing)


def start_vllm_servers(config: Config, model_dir: Path, stack: ExitStack) -> list[Any]:
    """`config.replicas` vLLM servers, stopped with `stack`: each on a Unix socket of its own in a
    private directory (`vllm_listen: socket`), or on ports `vllm_port`, `vllm_port + 1`, ... (`tcp`)."""
    from tracetrain.engines.gpus import visible_gpus
    from tracetrain.engines.vllm_server import VLLMServer, replica_placement

    gpus = [visible_gpus()[g] for g in config.engine_gpus]  # settled by `Config.settled`: one per replica
    servers = [VLLMServer(model_dir, port=config.vllm_port + i, listen=config.vllm_listen,
                          served_model_name=config.served_model_name, python=config.vllm_python,
                          dtype=config.engine_dtype,
                          extra_args=[*gpu_args(config), *config.vllm_args],
                          enable_lora=config.publish_mode() == "lora",
                          max_lora_rank=config.train.lora_rank,
                          env=replica_placement(i, config.replicas, gpus[i] if gpus else None))
               for i in range(config.replicas)]
    for server in servers:
        stack.callback(server.stop)
    for server in servers:  # all launched first: they load in parallel
        server.launch()
    for server in servers:
        server.wait_healthy()
    return servers


def gpu_args(config: Config) -> list[str]:
    """vLLM flags for the GPU plan: its memory share, and sleep mode when it sleeps during sync steps."""
    args = []
    if config.engine_memory_share is not None:
        args += ["--gpu-memory-utilization", f"{config.engine_memory_share:g}"]
    if config.engine_sleep == "on":
        args.append("--enable-sleep-mode")
    return args


def settle(config: Config, *, training_here: bool) -> Config:
    """`config` with every `auto` decided (`Config.settled`), refused with a sentence when the GPU split
    cannot work here."""
    try:
        settled = config.settled(training_here=training_here)
    except ValueError as exc:
        raise SystemExit(f"configuration error: {exc}") from None
    if settled.engine_gpus or settled.train.gpus:
        log.info("GPUs: vLLM replicas on %s (memory share %s%s), trainer on %s", settled.engine_gpus or "none",
                 settled.engine_memory_share, ", sleeps during sync steps" if settled.engine_sleep == "on" else "",
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
    probe = ProbeCheck(config.engine_dtype, config.publish_probe_tolerance) if config.publish_probe else None
    # Told apart without importing the in-process engine's module: it imports torch, which a gateway in
    # front of vLLM does not need (`pip install tracetrain` alone serves).
    if not isinstance(engine, ReplicaSet):
        return InProcessPublisher(engine)
    engines = [r.engine for r in engine.replicas]
    if mode == "lora":
        return ReplicaPublisher(engine, [VLLMLoRAPublisher(e) for e in engines], canary_share=config.canary_share,
                                probe=probe)
    return ReplicaPublisher(engine, [VLLMReloadPublisher(e, model_dir) for e in engines],
                            canary_share=config.canary_share, probe=probe)


def serve(config: Config, *, train: bool = False) -> None:
    config.check_access()  # first: refuse in a second, before importing torch or loading any model
    if config.gateway_workers > 1:
        if train:
            raise SystemExit("configuration error: --train runs the trainer inside the gateway process; with "
                             "--workers > 1 run it as its own process (`tracetrain train --gateway-url …`)")
        serve_workers(config)
        return
    if train and config.gateway_cpus:
        raise SystemExit("configuration error: gateway_cpus with --train would confine the trainer in the "
                         "gateway process to those CPUs; run it as its own process (`tracetrain train`)")
    import uvicorn
    from transformers import AutoTokenizer

    from tracetrain.compose import build_gateway, trainer_service
    from tracetrain.proxy.app import build_app
    from tracetrain.store.db import make_engine

    log.info("resolved config:\n%s", json.dumps(_redacted(config), indent=2, default=str))
    model_dir = _model_dir(config)
    # The store first: an out-of-date one is refused before vLLM spends a minute starting.
    db = make_engine(config.db_url, sqlite_synchronous=config.sqlite_synchronous)
    with ExitStack() as stack:
        engine = build_engine(config, model_dir, stack)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        gateway = build_gateway(config, engine, tokenizer, db, publisher=build_publisher(config, engine, model_dir),
                                services=[trainer_service(config, db, model_dir)] if train else [])
        log.info("gateway on http://%s:%d  (agents: OPENAI_BASE_URL=http://%s:%d/s/<session>/v1)",
                 config.host, config.port, config.host, config.port)
        if config.gateway_cpus:  # engine: transformers is refused when the config loads
            # Here, after any vLLM server started (a child would inherit the affinity): the event loop's
            # thread, and the store's threads it starts from now on.
            os.sched_setaffinity(0, config.gateway_cpus)
            log.info("gateway pinned to CPU %s", ",".join(map(str, config.gateway_cpus)))
        if train and config.train.uses_fsdp:
            from tracetrain.trainer.fsdp_backend import start_ray

            # Here, in the main thread, and before the handler below: Ray installs its own SIGTERM
            # handler, which would end the process without running the ExitStack.
            start_ray(config.train)
        # uvicorn re-raises SIGTERM after its graceful shutdown; turning it into SystemExit lets the
        # ExitStack stop the vLLM server instead of the process dying and orphaning it.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        uvicorn.run(build_app(gateway), host=config.host, port=config.port, **UVICORN_OPTIONS)


UVICORN_OPTIONS: dict[str, Any] = {
    "log_level": "warning", "timeout_graceful_shutdown": 5,
    # Per request, uvicorn formats an access-log line before the logger's level drops it, and its
    # proxy-headers middleware wraps every request; the gateway uses neither (the metrics count requests).
    "access_log": False, "proxy_headers": False,
}

WORKER_CONFIG = "TRACETRAIN_WORKER_CONFIG"
"""The resolved config, as JSON, handed from `serve --workers N` to each worker process."""


def serve_workers(config: Config) -> None:
    """`gateway_workers` worker processes on one port (`proxy/processes.py`). vLLM servers are started here, in the
    supervising process, and restarted here when they die; each worker reaches them by URL and builds
    its own gateway on the shared store (`worker_app`)."""
    import threading

    from tracetrain.proxy.processes import run_workers
    from tracetrain.store.db import make_engine

    log.info("resolved config:\n%s", json.dumps(_redacted(config), indent=2, default=str))
    model_dir = _model_dir(config)
    db = make_engine(config.db_url)  # an out-of-date store is refused once, here
    with ExitStack() as stack:
        servers = [] if config.engine_url else start_vllm_servers(config, model_dir, stack)
        urls = config.engine_url or [server.url for server in servers]
        stop = threading.Event()
        stack.callback(stop.set)
        # Full weights: the workers label each replica with what the store says it holds; a restarted
        # server holds its own model again.
        store = db if config.train.publish != "none" and config.publishes_full_weights() else None
        threading.Thread(target=_restart_dead, args=(servers, stop, store), daemon=True).start()
        # The workers reach the servers started here by URL; a socket travels as `unix:/path`, which
        # the workers run as this user may open (its directory is this user's alone).
        # Each worker is put on its CPU before it starts (processes.py): it does not pin itself again.
        worker_config = config.model_copy(update={"engine_url": urls, "replicas": 1, "engine": "vllm",
                                                  "gateway_cpus": []})
        os.environ[WORKER_CONFIG] = worker_config.model_dump_json()
        log.info("gateway on http://%s:%d with %d worker processes", config.host, config.port,
                 config.gateway_workers)
        # SIGTERM stops the workers and returns here; the ExitStack then stops the vLLM servers.
        run_workers("tracetrain.cli:worker_app", workers=config.gateway_workers, cpus=config.gateway_cpus,
                    host=config.host, port=config.port, options=UVICORN_OPTIONS)


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
    from tracetrain.store.db import make_engine

    config = Config.model_validate_json(os.environ[WORKER_CONFIG])
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = _model_dir(config)
    engine = build_engine(config, model_dir, ExitStack())  # by URL: nothing to stop
    gateway = build_gateway(config, engine, AutoTokenizer.from_pretrained(str(model_dir)),
                            make_engine(config.db_url, sqlite_synchronous=config.sqlite_synchronous),
                            publisher=build_publisher(config, engine, model_dir))
    return build_app(gateway)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _redacted(config: Config) -> dict[str, Any]:
    values = config.model_dump()
    values["api_keys"] = ["***"] * len(config.api_keys)
    values["admin_key"] = "***" if config.admin_key else None
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
    from tracetrain.store.db import make_engine
    from tracetrain.trainer.service import run_standalone

    log.info("resolved config:\n%s", json.dumps(_redacted(config), indent=2, default=str))
    run_standalone(config.train, make_engine(config.db_url), _model_dir(config), args.gateway_url,
                   config.admin_key)


def db_cmd(args: argparse.Namespace, config: Config) -> None:
    from tracetrain.store import schema
    from tracetrain.store.db import open_engine

    if args.action == "purge":
        purge_cmd(config)
        return
    engine = open_engine(config.db_url)
    if args.action == "current":
        current, has_tables = schema.revision(engine)
        found = current or ("tracetrain 0.1 (no revision)" if has_tables else "empty")
        print(f"store schema: {found}; this tracetrain: {schema.head()}")
        return
    try:
        before, after = schema.upgrade(engine)
    except schema.StoreOutOfDate as exc:
        raise SystemExit(str(exc)) from exc
    print(f"store schema: {before or 'none'} -> {after}")


def purge_cmd(config: Config) -> None:
    """Clear the content of every session past its retention now, as the gateway does on its schedule."""
    import asyncio

    from tracetrain.proxy.auth import fingerprint
    from tracetrain.store import retention
    from tracetrain.store.db import make_engine
    from tracetrain.store.writer import StoreWriter

    if not config.retains():
        print("nothing to purge: neither retention_days nor any key's retention_days is set")
        return
    engine = make_engine(config.db_url)  # an out-of-date store is refused
    rules = retention.Retention(config.retention_days,
                                {fingerprint(key): days for key, days in config.retention_by_key().items()})

    async def run() -> int:
        # Through a store writer, as the gateway writes: on SQLite it takes turns with running gateways.
        writer = StoreWriter(engine)
        await writer.start()
        try:
            return await retention.purge(writer.submit, engine, retention=rules, actor="cli")
        finally:
            await writer.stop()

    print(f"purged the content of {asyncio.run(run())} sessions")


def export_cmd(args: argparse.Namespace, config: Config) -> None:
    from tracetrain.store.db import make_engine
    from tracetrain.store.export import export

    rows = export(make_engine(config.db_url), Path(args.out), args.format)
    print(f"wrote {rows} trajectory segments to {args.out}")


def _help(name: str) -> str:
    """A flag's help: the first sentence of its setting's docstring (docs/configuration.md has it all)."""
    text = " ".join((Config.model_fields[name].description or "").split())
    first = text.split(". ")[0].rstrip(".")
    return (first + ".").replace("%", "%%")  # argparse formats help with %


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracetrain")
    parser.add_argument("--config", type=Path, help="YAML config file")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="gateway + vLLM + an example agent posting rewards (see tracetrain.demo)")
    serve_p = sub.add_parser("serve", help="run the gateway in front of an engine")
    for flag, kind in (("host", str), ("port", int), ("engine", str), ("model", str), ("served-model-name", str),
                       ("db-url", str), ("vllm-port", int), ("admin-key", str), ("replicas", int)):
        serve_p.add_argument(f"--{flag}", type=kind, help=_help(flag.replace("-", "_")))
    serve_p.add_argument("--workers", type=int, dest="gateway_workers", help=_help("gateway_workers"))
    serve_p.add_argument("--gateway-cpus", dest="gateway_cpus", help=_help("gateway_cpus"))
    serve_p.add_argument("--engine-url", action="append", dest="engine_url",
                         help=_help("engine_url") + " Repeatable.")
    serve_p.add_argument("--api-key", action="append", dest="api_keys", help=_help("api_keys") + " Repeatable.")
    serve_p.add_argument("--train", action="store_true", help="Run the trainer in the gateway process.")
    train_p = sub.add_parser("train", help="run the trainer as its own process against the same store")
    for flag in ("db-url", "model", "admin-key"):
        train_p.add_argument(f"--{flag}", help=_help(flag.replace("-", "_")))
    train_p.add_argument("--gateway-url", help="gateway that publishes each new version (admin key needed)")
    for p in (serve_p, train_p):
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any setting: train.lr=1e-4, or lr=1e-4 for a trainer-only name; admission=staleness "
                            "(repeatable; the same keys in every subcommand)")
    db_p = sub.add_parser("db", help="the store: `current` shows its schema revision, `upgrade` migrates it, "
                          "`purge` clears the content of sessions past their retention")
    db_p.add_argument("action", choices=["current", "upgrade", "purge"],
                      help="current: the schema revision; upgrade: migrate to this tracetrain's; purge: clear the "
                      "content of sessions older than retention_days (keeping their figures)")
    db_p.add_argument("--db-url", help=_help("db_url"))
    db_p.add_argument("--retention-days", type=int, help=_help("retention_days") + " (purge; default: the config's)")
    export_p = sub.add_parser("export", help="export trajectories to JSONL or Parquet")
    export_p.add_argument("--db-url", help=_help("db_url"))
    export_p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl",
                          help="JSON lines, or Parquet (needs the export extra).")
    export_p.add_argument("--out", required=True, help="File to write the trajectory segments to.")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from tracetrain.demo.run import main as demo

        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        demo(argv[1:])
        return
    args = _parser().parse_args(argv)
    skip = ("config", "command", "format", "out", "train", "gateway_url", "set", "action")
    # A flag left out is None here; only given flags override (`--set KEY=null` may set a None).
    overrides = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    try:
        config = load_config(args.config, **{**parse_set(getattr(args, "set", [])), **overrides})
    except ValidationError as exc:  # a sentence per problem, not a traceback
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in exc.errors())
        raise SystemExit(f"configuration error: {problems}") from None
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
