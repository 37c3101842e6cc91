"""The `fsdp` backend: torch FSDP2 over `workers` Ray actors, one per device (trainer/fsdp_worker.py).

Plain Ray actors rather than Ray Train: the loop already owns everything Ray Train would (the step
schedule, checkpoints, resumption from the store), so all that is needed from Ray is placing one
process per device, on this machine or a cluster, and calling into them; Ray Train's trainer/session
layer would sit between the loop and its workers without doing anything for them.

Each step splits the batch into one share per worker with nearly equal token counts, and every worker
runs the same number of micro-batches (see `BatchShare`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from tracetrain.config import TrainConfig
from tracetrain.trainer.backend import StepBatch
from tracetrain.trainer.data import balance, pack
from tracetrain.trainer.devices import resolve_device
from tracetrain.trainer.fsdp_worker import FSDPWorker
from tracetrain.trainer.step import BatchShare

log = logging.getLogger(__name__)

DISTRIBUTED_MISSING = "train.workers > 1 needs Ray, in the distributed extra: pip install 'tracetrain[distributed]'"


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(DISTRIBUTED_MISSING) from exc
    return ray


def start_ray(cfg: TrainConfig) -> bool:
    """Connect to `cfg.ray_address`, or start a local Ray; False when this process already had one."""
    ray = _ray()
    if ray.is_initialized():
        return False
    ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    return True


class FSDPBackend:
    def __init__(self, cfg: TrainConfig, base_dir: Path, resume: Path | None) -> None:
        ray = _ray()
        self.cfg = cfg
        started = time.perf_counter()
        self.owns_ray = start_ray(cfg)
        ray_up = time.perf_counter()
        gpu = resolve_device(cfg) == "cuda"
        # On CPU a worker's device is its share of the cores (Ray sets its threads to match); on a
        # cluster the other machines' cores are unknown here, so one each.
        cpus = 1 if gpu or cfg.ray_address else max(1, (os.cpu_count() or 1) // cfg.workers)
        actor = ray.remote(num_cpus=cpus, num_gpus=1 if gpu else 0)(FSDPWorker)
        self.workers = [actor.remote(rank, cfg.workers) for rank in range(cfg.workers)]
        master = ray.get(self.workers[0].rendezvous.remote())
        setups = ray.get([w.setup.remote(cfg, base_dir, master, resume) for w in self.workers])
        self.startup = {"ray_s": ray_up - started, "workers_s": time.perf_counter() - ray_up,
                        "process_group_s": max(s["process_group_s"] for s in setups)}
        log.info("fsdp: %d workers on %s, Ray up in %.1fs, workers ready in %.1fs (process group %.1fs); "
                 "parameters + optimizer per worker %s MiB", cfg.workers, "GPUs" if gpu else "CPU",
                 self.startup["ray_s"], self.startup["workers_s"], self.startup["process_group_s"],
                 [round((s["param_bytes"] + s["optimizer_bytes"]) / 2**20) for s in setups])

    def step(self, batch: StepBatch) -> dict[str, Any]:
        ray = _ray()
        samples, advantages = batch.samples, batch.advantages
        assert advantages is not None, "fsdp trains rl: it needs advantages"
        shares = balance([len(s.input_ids) for s in samples], self.cfg.workers)
        passes = max(len(pack(share, [len(s.input_ids) for s in samples], self.cfg.micro_batch_tokens))
                     for share in shares if share)
        tokens = sum(s.num_sampled for s in samples)
        futures = []
        for worker, share in zip(self.workers, shares, strict=True):
            live = bool(share)
            chosen = share if live else [0]  # nothing to train on: a borrowed sample at weight 0
            futures.append(worker.step.remote([samples[i] for i in chosen], [advantages[i] for i in chosen],
                                              BatchShare(tokens, len(samples), self.cfg.workers, passes, live)))
        results = ray.get(futures)
        summed = {k: sum(r[k] for r in results) for k in ("loss", "kl", "entropy", "is_weight", "trained_tokens",
                                                          "clip_fraction") if all(k in r for r in results)}
        slowest = max(r["step_seconds"] for r in results)
        return {**summed, "grad_norm": results[0]["grad_norm"], "step_seconds": slowest,
                "tokens_per_second": sum(r["tokens_per_second"] * r["step_seconds"] for r in results) / slowest,
                "micro_batches": passes, "workers": self.cfg.workers, "memory": [r["memory"] for r in results],
                "worker_tokens": [r["trained_tokens"] for r in results], **self.startup}

    def save(self, path: Path, *, merged: bool) -> None:
        _ray().get([w.save.remote(path, merged) for w in self.workers])

    def weights(self) -> dict[str, Any]:
        """The full trainable weights, gathered (for tests and tools; the loop never needs them)."""
        ray = _ray()
        return ray.get([w.weights.remote() for w in self.workers])[0]  # type: ignore[no-any-return]

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        finally:
            for worker in self.workers:
                ray.kill(worker)
            self.workers = []
            if self.owns_ray:
                ray.shutdown()
