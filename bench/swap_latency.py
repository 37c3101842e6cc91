"""Swap latency: from a checkpoint on disk to the first response served by the new version, under load.

For each publish path (vLLM LoRA load, vLLM in-place reload in "wait" and "keep" pause modes, and the
in-process transformers engine with full and LoRA checkpoints), on SmolLM2-135M-Instruct:

- a light load runs throughout: `--load` clients each streaming `--max-tokens`-token generations back
  to back through the engine; every one must end with finish_reason stop/length (a swap that aborts
  or fails a request counts as a failure);
- for each swap, the clock starts when the publisher is handed the (already written) checkpoint, and a
  prober sends one-token greedy requests back to back. Each version has a signature, the greedy token
  and its logprob for the probe prompt, computed beforehand with transformers on that version's
  weights; the clock stops when a probe's answer matches the new version's signature (|Δlogprob| <
  1e-3). Probes matching no known version are counted (they would mean mixed or wrong weights).

Checkpoints are written before the clock starts (the trainer's cost, shown as "write s"). Paths run
one after another on the same machine, so on a small CPU box they do not compete with each other.

    python -m bench.swap_latency                # all paths, 3 swaps each
    python -m bench.swap_latency --skip-vllm    # in-process only
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import (
    OUT_DIR,
    ResultTable,
    add_results_dir_argument,
    command_line,
    console,
    machine_line,
    percentile,
    run_started,
    write_results,
)
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.models import smollm2_dir
from tracetrain.engines.publishing import Checkpoint, Publisher
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_publish import VLLMLoRAPublisher, VLLMReloadPublisher
from tracetrain.engines.vllm_server import VLLMServer, find_vllm_python

SIGNATURE_TOLERANCE = 1e-3
PROBE = SamplingParams(max_tokens=1, temperature=0.0)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --- checkpoints and their signatures ------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """What a one-token greedy probe returns under one version's weights."""

    token: int
    logprob: float


@dataclass
class Versions:
    base_dir: Path
    probe_prompt: list[int]
    signatures: dict[int, Signature] = field(default_factory=dict)
    write_s: dict[int, float] = field(default_factory=dict)

    def identify(self, token: int, logprob: float) -> int | None:
        for version, sig in self.signatures.items():
            if sig.token == token and abs(sig.logprob - logprob) < SIGNATURE_TOLERANCE:
                return version
        return None


def signature(model: Any, prompt: list[int]) -> Signature:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    token = int(torch.argmax(logprobs))
    return Signature(token, float(logprobs[token]))


def write_lora(base: Any, path: Path, seed: int) -> tuple[float, Any]:
    """A rank-8 adapter with random B: seconds to save it, and the merged model (for the signature)."""
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.03)
    started = time.perf_counter()
    model.save_pretrained(str(path))
    write_s = time.perf_counter() - started
    return write_s, PeftModel.from_pretrained(copy.deepcopy(base), str(path)).merge_and_unload()


def write_full(base: Any, tokenizer: Any, path: Path, seed: int) -> tuple[float, Any]:
    """The base model with its MLP down-projections perturbed, saved as a complete model directory:
    seconds to save it, and the model."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "down_proj" in name:
                param.add_(torch.randn_like(param) * 0.01)
    started = time.perf_counter()
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return time.perf_counter() - started, model


def build_checkpoints(root: Path, swaps: int) -> tuple[Versions, list[Checkpoint], list[Checkpoint]]:
    """`swaps` LoRA and `swaps` full checkpoints (versions 1.. and 101..) with their signatures."""
    base_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    messages = [{"role": "user", "content": "Name one colour."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    versions = Versions(base_dir, prompt, {0: signature(base, prompt)})
    loras: list[Checkpoint] = []
    fulls: list[Checkpoint] = []
    for i in range(swaps):
        for kind, version, writer in (("lora", 1 + i, write_lora), ("full", 101 + i, write_full)):
            path = root / f"{kind}-v{version}"
            args = (base, path, version) if kind == "lora" else (base, tokenizer, path, version)
            versions.write_s[version], model = writer(*args)
            versions.signatures[version] = signature(model.eval(), prompt)
            (loras if kind == "lora" else fulls).append(Checkpoint(version, path, kind))  # type: ignore[arg-type]
    distinct = {(s.token, round(s.logprob, 2)) for s in versions.signatures.values()}
    if len(distinct) < len(versions.signatures):
        console.print("[yellow]warning: some versions share a probe signature; latencies may be early")
    return versions, loras, fulls


# --- load, probes, one path ------------------------------------------------------------------------------


@dataclass
class Load:
    ok: int = 0
    failed: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


async def load_client(engine: Any, prompt: list[int], max_tokens: int, load: Load, stop: asyncio.Event) -> None:
    seed = 0
    while not stop.is_set():
        seed += 1
        started = time.perf_counter()
        try:
            finish = None
            async for delta in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=seed)):
                finish = delta.finish_reason or finish
                load.tokens += len(delta.token_ids)
            if finish not in ("stop", "length"):
                raise RuntimeError(f"finish_reason {finish!r}")
            load.ok += 1
            load.latencies.append(time.perf_counter() - started)
        except Exception as exc:  # every failure is a result here
            load.failed += 1
            load.errors.append(f"{type(exc).__name__}: {exc}"[:200])


@dataclass
class Swap:
    version: int
    publish_s: float
    served_s: float
    probes: int
    unknown: int


async def swap_once(engine: Any, publisher: Publisher, checkpoint: Checkpoint, versions: Versions) -> Swap:
    """Publish and probe concurrently; the swap is done when a probe answers with the new signature."""
    started = time.perf_counter()
    publish_done: list[float] = []

    async def publish() -> None:
        await publisher.publish(checkpoint)
        publish_done.append(time.perf_counter() - started)

    task = asyncio.create_task(publish())
    probes = unknown = 0
    try:
        while True:
            deltas = [d async for d in engine.generate(versions.probe_prompt, PROBE)]
            probes += 1
            served = versions.identify(deltas[-1].token_ids[0], deltas[-1].logprobs[0])
            if served is None:
                unknown += 1
            elif served == checkpoint.version:
                served_s = time.perf_counter() - started
                break
            if task.done() and task.exception() is not None:
                break
    finally:
        await task  # re-raises a publish failure
    return Swap(checkpoint.version, publish_done[0], served_s, probes, unknown)


@dataclass
class PathResult:
    name: str
    kind: str
    swaps: list[Swap]
    load: Load
    load_tok_s: float
    """Tokens per second the load clients got over the whole path, swaps included."""
    solo_ms_per_token: float
    """One greedy request alone, on the last published version (with LoRA: the adapter applied)."""


async def run_path(
    name: str,
    engine: Any,
    publisher: Publisher,
    checkpoints: list[Checkpoint],
    versions: Versions,
    args: argparse.Namespace,
    reset: Callable[[], Awaitable[None]] | None = None,
) -> PathResult:
    console.print(f"[bold]{name}[/]: {len(checkpoints)} swaps under {args.load} streaming clients")
    load, stop = Load(), asyncio.Event()
    clients = [
        asyncio.create_task(load_client(engine, versions.probe_prompt, args.max_tokens, load, stop))
        for _ in range(args.load)
    ]
    swaps: list[Swap] = []
    started = time.perf_counter()
    try:
        await asyncio.sleep(args.warmup)
        for checkpoint in checkpoints:
            swap = await swap_once(engine, publisher, checkpoint, versions)
            console.print(
                f"  v{swap.version}: publish {swap.publish_s:.2f} s, served {swap.served_s:.2f} s, "
                f"{swap.probes} probes ({swap.unknown} unknown)"
            )
            swaps.append(swap)
            await asyncio.sleep(args.gap)
        stop.set()
        await asyncio.gather(*clients)
        load_tok_s = load.tokens / (time.perf_counter() - started)
        solo = await solo_ms_per_token(engine, versions.probe_prompt, args.max_tokens)
    finally:
        stop.set()
        await asyncio.gather(*clients)
        if reset is not None:
            await reset()
    return PathResult(name, checkpoints[0].kind, swaps, load, load_tok_s, solo)


async def solo_ms_per_token(engine: Any, prompt: list[int], max_tokens: int, repeats: int = 3) -> float:
    """Median milliseconds per generated token of a greedy request with nothing else running."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    per_token = []
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = sum([len(d.token_ids) async for d in engine.generate(prompt, params)])
        per_token.append(1000 * (time.perf_counter() - started) / max(tokens, 1))
    return percentile(per_token, 50)


# --- engines ---------------------------------------------------------------------------------------------


async def vllm_paths(
    args: argparse.Namespace, versions: Versions, loras: list[Checkpoint], fulls: list[Checkpoint]
) -> list[PathResult]:
    server = VLLMServer(
        versions.base_dir,
        served_model_name="smollm2",
        max_model_len=4096,
        enable_lora=True,
        log_path=OUT_DIR / "swap_latency_vllm.log",
    )
    console.print(f"starting vLLM (log: {server.log_path}) …")
    results = []
    with server:
        engine = VLLMEngine(server.url, server.model_name, timeout=300)
        lora = VLLMLoRAPublisher(engine)

        async def base_adapter() -> None:
            engine.use_adapter(None, 0)

        results.append(await run_path("vLLM LoRA load", engine, lora, loras, versions, args, base_adapter))
        for mode in ("wait", "keep"):
            reload = VLLMReloadPublisher(engine, versions.base_dir, pause_mode=mode)

            async def base_weights(publisher: VLLMReloadPublisher = reload) -> None:
                await publisher.publish(Checkpoint(0, versions.base_dir, "full"))

            name = f"vLLM reload (pause {mode})"
            results.append(await run_path(name, engine, reload, fulls, versions, args, base_weights))
        await engine.close()
    return results


async def in_process_paths(
    args: argparse.Namespace, versions: Versions, loras: list[Checkpoint], fulls: list[Checkpoint]
) -> list[PathResult]:
    engine = TransformersEngine(versions.base_dir, model_name="smollm2")
    publisher = InProcessPublisher(engine)
    results = []
    for name, checkpoints in (("in-process full", fulls), ("in-process LoRA", loras)):

        async def base_weights() -> None:
            await publisher.publish(Checkpoint(0, versions.base_dir, "full"))

        results.append(await run_path(name, engine, publisher, checkpoints, versions, args, base_weights))
    await engine.close()
    return results


# --- report ----------------------------------------------------------------------------------------------


def table(results: list[PathResult], versions: Versions) -> ResultTable:
    result = ResultTable(
        "Checkpoint written → first response from the new version (SmolLM2-135M, CPU)",
        [
            "path",
            "ckpt",
            "swaps",
            "write s",
            "publish() s p50",
            "served s p50",
            "served s max",
            "unknown probes",
            "requests ok",
            "failed",
            "request s p50",
            "load tok/s",
            "solo ms/token",
        ],
    )
    for r in results:
        served = [s.served_s for s in r.swaps]
        writes = [versions.write_s[s.version] for s in r.swaps]
        result.add(
            r.name,
            r.kind,
            len(r.swaps),
            f"{percentile(writes, 50):.2f}",
            f"{percentile([s.publish_s for s in r.swaps], 50):.2f}",
            f"{percentile(served, 50):.2f}",
            f"{max(served, default=float('nan')):.2f}",
            sum(s.unknown for s in r.swaps),
            r.load.ok,
            r.load.failed,
            f"{percentile(r.load.latencies, 50):.2f}",
            f"{r.load_tok_s:.1f}",
            f"{r.solo_ms_per_token:.0f}",
        )
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.swap_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--swaps", type=int, default=3, help="swaps per path")
    p.add_argument("--load", type=int, default=2, help="concurrent streaming clients during the swaps")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per load request")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the first swap")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between swaps")
    p.add_argument("--skip-vllm", action="store_true", help="only the in-process engine")
    p.add_argument("--skip-in-process", action="store_true", help="only vLLM")
    add_results_dir_argument(p)
    return p


async def run(args: argparse.Namespace) -> tuple[list[PathResult], ResultTable]:
    root = Path(tempfile.mkdtemp(prefix="swap-latency-"))
    try:
        console.print(f"writing {args.swaps} LoRA and {args.swaps} full checkpoints to {root} …")
        versions, loras, fulls = build_checkpoints(root, args.swaps)
        results: list[PathResult] = []
        if not args.skip_vllm:
            if find_vllm_python() is None:
                console.print("[yellow]vLLM is not installed: skipping the vLLM paths")
            else:
                results += await vllm_paths(args, versions, loras, fulls)
        if not args.skip_in_process:
            results += await in_process_paths(args, versions, loras, fulls)
        return results, table(results, versions)
    finally:
        shutil.rmtree(root, ignore_errors=True)


NOTES = [
    "write s: writing the checkpoint (peft `save_pretrained` for LoRA; `save_pretrained` + tokenizer for "
    "full), before the clock starts. publish() s: the publisher's call. served s: checkpoint handed to the "
    "publisher → a one-token greedy probe answers with the new version's signature (greedy token and its "
    "logprob computed with transformers on that version's weights, within 1e-3). unknown probes: answers "
    "matching no version (mixed or wrong weights); must be 0.",
    "failed: load requests that raised or ended with a finish_reason other than stop/length (vLLM's "
    "default pause mode, abort, would end them with finish_reason abort); must be 0.",
    "vLLM reload, pause wait: in-flight requests finish on the old weights before the reload, so the swap "
    "waits for the longest running request; pause keep freezes them and continues them on the new "
    "weights (faster, but those generations mix two versions).",
    "request s p50 and load tok/s: the load requests during the path, swaps included; solo ms/token: one "
    "greedy request alone afterwards, on the last published version (for LoRA, with the adapter applied).",
    "In-process: one worker thread serves requests in arrival order; the swap runs between two requests, "
    "after those already queued. A LoRA publish merges the adapter into a fresh copy of the base model.",
]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    args = _parser().parse_args(argv)
    console.print(machine_line())
    started = run_started()
    results, result_table = asyncio.run(run(args))
    console.print(result_table.rich())
    notes = list(NOTES)
    notes.insert(
        1,
        f"Load: {args.load} clients streaming {args.max_tokens}-token sampled generations back "
        "to back during each path.",
    )
    errors = [e for r in results for e in r.load.errors]
    if errors:
        notes.append(f"errors: {errors[:5]}")
    raw = {"arguments": vars(args), "paths": [asdict(r) for r in results]}
    path = write_results("swap_latency", "Swap latency", command_line("bench.swap_latency", argv), [result_table],
                         notes, raw=raw, started=started, results_dir=args.results_dir)
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
