"""Full-weight reloads through one and two gateway processes on vLLM CPU: what the agreement between the
processes costs (proxy/replica_sync.py), and whether any call records a version its weights were not.

Arms: `tracetrain serve --workers 1` and `--workers 2` (`train.publish: reload`), each a fresh gateway on
its own SQLite store, in front of the same vLLM server (started here, dev mode). In every round both
arms run, in rotated order, with the same load and the same checkpoints: the server's base weights are
restored first, `--agents` threads send greedy chat calls (`--max-tokens` tokens, logprobs) on fresh
connections (so the kernel spreads them over the workers), and after `--settle` seconds each of
`--reloads` full checkpoints is published through the gateway (`POST /v1/policies`, then marked
published in the store, as `tracetrain train --gateway-url` does), `--settle` seconds apart.

Every version's signature, the greedy first token's logprob on the agents' prompt, is computed with
transformers before the runs. A call is mislabelled when its first-token logprob is nearer another
version's signature than the one of the version it recorded; unknown when it is within 1e-2 of none.
Both must be 0. Fixed before the runs: the prompt, the checkpoints (MLP down-projections perturbed,
scale 0.05, seeds 1..reloads), the metric.

    python -m bench.reload_workers                 # about 6 minutes on a 2-core CPU
    python -m bench.reload_workers --rounds 1 --reloads 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from sqlmodel import Session
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import OUT_DIR, ResultTable, ServerProcess, console, free_port, percentile, python_cmd, write_results
from bench.swap_latency import signature
from tracetrain.engines.models import smollm2_dir
from tracetrain.engines.publishing import Checkpoint
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_publish import VLLMReloadPublisher
from tracetrain.engines.vllm_server import VLLMServer
from tracetrain.store.db import open_engine
from tracetrain.store.models import Policy, utcnow

MODEL = "smollm2"
PROMPT = "Name one colour."
UNKNOWN_TOLERANCE = 1e-2


@dataclass
class Answer:
    started: float
    seconds: float
    label: int | None
    logprob: float | None


@dataclass
class ArmRun:
    publish_s: list[float] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    failed: int = 0
    windows: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each publish, for the calls that overlapped one."""


def checkpoints(root: Path, count: int) -> tuple[list[Path], dict[int, float]]:
    """`count` full checkpoints and every version's signature (version 0: the base weights)."""
    base_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                return_dict=False))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    signatures = {0: signature(base, prompt).logprob}
    paths = []
    for version in range(1, count + 1):
        torch.manual_seed(version)
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "down_proj" in name:
                    param.add_(torch.randn_like(param) * 0.05)
        path = root / f"v{version}"
        model.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        signatures[version] = signature(model, prompt).logprob
        paths.append(path)
    return paths, signatures


def restore_base(server: VLLMServer, base_dir: Path) -> None:
    """Put the server's own weights back before an arm, with the project's reload publisher."""

    async def reload() -> None:
        engine = VLLMEngine(server.url, MODEL, timeout=300)
        try:
            await VLLMReloadPublisher(engine, base_dir).publish(Checkpoint(0, base_dir, "full"))
        finally:
            await engine.close()

    asyncio.run(reload())


def agent(url: str, max_tokens: int, stop: threading.Event, run: ArmRun) -> None:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    while not stop.is_set():
        started = time.monotonic()
        try:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600,
                                  headers={"Connection": "close"})
        except httpx.HTTPError:
            run.failed += 1
            continue
        if response.status_code != 200:
            run.failed += 1
            continue
        logprob = response.json()["choices"][0]["logprobs"]["content"][0]["logprob"]
        run.answers.append(Answer(started, time.monotonic() - started, int(response.headers["x-policy-version"]),
                                  logprob))


def run_arm(workers: int, server: VLLMServer, paths: list[Path], args: argparse.Namespace) -> ArmRun:
    port = free_port()
    db_url = f"sqlite:///{OUT_DIR / f'reload-workers-{workers}-{port}.db'}"
    cmd = python_cmd("-m", "tracetrain.cli", "serve", "--workers", str(workers), "--engine", "vllm",
                     "--engine-url", server.url, "--model", str(smollm2_dir()), "--served-model-name", MODEL,
                     "--port", str(port), "--db-url", db_url, "--set", "train.lora=false",
                     "--set", "train.publish=reload")
    gateway = ServerProcess(f"reload-workers-{workers}", cmd, f"http://127.0.0.1:{port}").start(timeout=300)
    run, stop = ArmRun(), threading.Event()
    threads = [threading.Thread(target=agent, args=(gateway.url, args.max_tokens, stop, run))
               for _ in range(args.agents)]
    try:
        for thread in threads:
            thread.start()
        for version, path in enumerate(paths, start=1):
            time.sleep(args.settle)
            started = time.monotonic()
            response = httpx.post(f"{gateway.url}/v1/policies", timeout=900,
                                  json={"version": version, "checkpoint": str(path), "kind": "full"})
            run.windows.append((started, time.monotonic()))
            if response.status_code != 200:
                raise RuntimeError(f"publishing version {version} failed: {response.text}")
            run.publish_s.append(time.monotonic() - started)
            with Session(open_engine(db_url)) as db:
                db.add(Policy(version=version, checkpoint=str(path), kind="full", published_at=utcnow()))
                db.commit()
        time.sleep(args.settle)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
        gateway.stop()
    return run


def classify(answer: Answer, signatures: dict[int, float]) -> str:
    if answer.label is None or answer.logprob is None:
        return "unknown"
    nearest = min(signatures, key=lambda v: abs(signatures[v] - answer.logprob))  # type: ignore[operator]
    if abs(signatures[nearest] - answer.logprob) > UNKNOWN_TOLERANCE:
        return "unknown"
    return "ok" if abs(signatures[answer.label] - answer.logprob) <= abs(signatures[nearest] - answer.logprob) \
        else "mislabelled"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reloads", type=int, default=2, help="full checkpoints published per arm and round")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of load before, between, after reloads")
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="reload-workers-") as tmp:
        console.print("writing checkpoints and their signatures …")
        paths, signatures = checkpoints(Path(tmp), args.reloads)
        if len({round(s, 3) for s in signatures.values()}) < len(signatures):
            raise SystemExit(f"two versions share a signature, calls cannot be told apart: {signatures}")
        server = VLLMServer(smollm2_dir(), served_model_name=MODEL, max_model_len=4096,
                            log_path=OUT_DIR / "reload_workers_vllm.log")
        console.print(f"starting vLLM (log: {server.log_path}) …")
        runs: dict[int, list[ArmRun]] = {1: [], 2: []}
        with server:
            for round_ in range(args.rounds):
                for workers in ([1, 2] if round_ % 2 == 0 else [2, 1]):
                    restore_base(server, smollm2_dir())
                    run = run_arm(workers, server, paths, args)
                    runs[workers].append(run)
                    console.print(f"round {round_ + 1}, {workers} worker(s): publish s {run.publish_s}, "
                                  f"{len(run.answers)} calls, {run.failed} failed")
            restore_base(server, smollm2_dir())
    write(runs, signatures, args)


def write(runs: dict[int, list[ArmRun]], signatures: dict[int, float], args: argparse.Namespace) -> None:
    table = ResultTable("Full-weight reloads under load, per arm (all rounds)",
                        ["gateway processes", "reloads", "publish s p50", "publish s min–max", "calls",
                         "failed", "mislabelled", "unknown", "call s p50", "call s p99",
                         "call s max during a reload"])
    for workers, arm in runs.items():
        publish = [s for run in arm for s in run.publish_s]
        answers = [a for run in arm for a in run.answers]
        kinds = [classify(a, signatures) for a in answers]
        seconds = [a.seconds for a in answers]
        during = [a.seconds for run in arm for a in run.answers
                  if any(a.started < end and a.started + a.seconds > start for start, end in run.windows)]
        table.add(workers, len(publish), f"{statistics.median(publish):.2f}",
                  f"{min(publish):.2f}–{max(publish):.2f}", len(answers), sum(r.failed for r in arm),
                  kinds.count("mislabelled"), kinds.count("unknown"), f"{percentile(seconds, 50):.2f}",
                  f"{percentile(seconds, 99):.2f}", f"{max(during, default=0):.2f}")
    console.print(table.rich())
    command = (f"python -m bench.reload_workers --rounds {args.rounds} --reloads {args.reloads} --agents {args.agents} "
               f"--max-tokens {args.max_tokens} --settle {args.settle}")
    notes = [
        "Signatures (greedy first-token logprob per version, transformers): "
        + ", ".join(f"v{v} {s:.4f}" for v, s in signatures.items()) + ".",
        "publish s: POST /v1/policies until it answered: with 2 processes it includes waiting for the other "
        "process to stop sending to the replica and finish its calls there (acknowledged in the store, polled "
        "every 0.25 s); the reload itself pauses vLLM (mode wait), reloads and resumes.",
        "One vLLM replica: calls wait during a reload in both arms (there is no other replica to go to), so "
        "'call s max during a reload' is the stall an agent sees.",
        "Arms take turns in rotated order each round; vLLM's base weights are restored before each arm.",
    ]
    path = write_results("reload_workers", "Full-weight reloads with one and two gateway processes", command,
                         [table], notes)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()

