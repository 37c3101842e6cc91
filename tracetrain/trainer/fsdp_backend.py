"""The `fsdp` backend: torch FSDP2 over `workers` Ray actors, one per device (trainer/fsdp_worker.py).

Plain Ray actors rather than Ray Train: the loop already owns everything Ray Train would (the step
schedule, checkpoints, resumption from the store), so all that is needed from Ray is placing one
process per device, on this machine or a cluster, and calling into them; Ray Train's trainer/session
layer would sit between the loop and its workers without doing anything for them.

Each step splits the batch into one share per worker with nearly equal token counts, and every worker
runs the same number of micro-batches (see `BatchShare`).

Workers are placed through one placement group (a bundle per worker, `PACK`; see `place_workers`), so
on a cluster they land on as few nodes as hold them, and on several nodes once one node is full.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import TrainConfig
from tracetrain.trainer.backend import StepBatch
from tracetrain.trainer.data import balance, pack_samples
from tracetrain.trainer.devices import resolve_device, trainer_visible_devices
from tracetrain.trainer.fsdp_worker import FSDPWorker
from tracetrain.trainer.step import BatchShare

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 600.0
"""How long the workers' placement group may wait for resources (an autoscaling cluster adds nodes in
the meantime) before the backend gives up with what it asked for and what the cluster has free."""
PLACEMENT_REPORT_S = 30.0
"""How often a waiting placement group is reported in the log."""

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
    devices = trainer_visible_devices(cfg)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if devices is not None:
        # A local Ray counts and hands out the GPUs its processes see when they start: only the trainer's.
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=True,
                 logging_level=logging.WARNING)
    finally:
        if devices is not None:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return True


def place_workers(bundle: dict[str, float], workers: int) -> Any:
    """A ready placement group with one `bundle` per worker; RuntimeError when the cluster cannot hold it.

    Strategy PACK: FSDP all-gathers parameters and reduce-scatters gradients for every layer, so workers
    on one node (NVLink, shared memory) step faster than workers talking over the network; PACK fills a
    node before using the next, and is soft: bundles that do not fit on one node go to others. So
    2 nodes x 8 GPUs with 16 workers gives 8 + 8, and nodes offering one device (or one CPU) each get one
    worker each. SPREAD would scatter 4 workers over 4 nodes where one holds them all; STRICT_SPREAD
    would refuse more workers than nodes.
    """
    ray = _ray()
    group = ray.util.placement_group([dict(bundle) for _ in range(workers)], strategy="PACK")
    waited = 0.0
    while not group.wait(timeout_seconds=PLACEMENT_REPORT_S):
        waited += PLACEMENT_REPORT_S
        free = ray.available_resources()
        if waited >= PLACEMENT_TIMEOUT_S:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"fsdp: the Ray cluster cannot place {workers} workers of {bundle} each "
                               f"(free now: {free}); lower train.workers or add nodes")
        log.warning("fsdp: still waiting for Ray to place %d workers of %s each (free now: %s)",
                    workers, bundle, free)
    return group


class FSDPBackend:
    def __init__(self, cfg: TrainConfig, base_dir: Path, resume: Path | None) -> None:
        self.cfg = cfg
        started = time.perf_counter()
        self.owns_ray = start_ray(cfg)
        ray_up = time.perf_counter()
        gpu = resolve_device(cfg) == "cuda"
        # On CPU a worker's device is its share of the cores (Ray sets its threads to match); on a
        # cluster the other machines' cores are unknown here, so one each.
        cpus = 1 if gpu or cfg.ray_address else max(1, (os.cpu_count() or 1) // cfg.workers)
        self.workers: list[Any] = []
        self.group: Any = None
        try:
            self._start(cfg, base_dir, resume, gpu, cpus)
        except BaseException:
            self._release()
            raise
        self.startup["ray_s"] = ray_up - started
        self.startup["workers_s"] = time.perf_counter() - ray_up
        log.info("fsdp: %d workers on %s across %d Ray node(s), Ray up in %.1fs, workers ready in %.1fs "
                 "(process group %.1fs); parameters + optimizer per worker %s MiB", cfg.workers,
                 "GPUs" if gpu else "CPU", len(set(self.nodes)), self.startup["ray_s"], self.startup["workers_s"],
                 self.startup["process_group_s"], self.memory_mib)

    def _start(self, cfg: TrainConfig, base_dir: Path, resume: Path | None, gpu: bool, cpus: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = _ray()
        bundle = {"CPU": float(cpus), "GPU": 1.0} if gpu else {"CPU": float(cpus)}
        self.group = place_workers(bundle, cfg.workers)
        actor = ray.remote(num_cpus=cpus, num_gpus=1 if gpu else 0)(FSDPWorker)
        # rank r takes bundle r; which node holds which bundle is Ray's choice, and FSDP's collectives span
        # all ranks alike, so the order does not matter
        self.workers = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=rank)).remote(rank, cfg.workers)
            for rank in range(cfg.workers)]
        self.master: tuple[str, int] = ray.get(self.workers[0].rendezvous.remote())
        setups = ray.get([w.setup.remote(cfg, base_dir, self.master, resume) for w in self.workers])
        self.nodes: list[str] = [s["node_id"] for s in setups]  # the Ray node of each rank, by rank
        self.memory_mib = [round((s["param_bytes"] + s["optimizer_bytes"]) / 2**20) for s in setups]
        self.startup: dict[str, float] = {"process_group_s": max(s["process_group_s"] for s in setups)}

    def step(self, batch: StepBatch) -> dict[str, Any]:
        ray = _ray()
        samples, advantages = batch.samples, batch.advantages
        assert advantages is not None, "fsdp trains rl: it needs advantages"
        shares = balance([len(s.input_ids) for s in samples], self.cfg.workers)
        passes = max(len(pack_samples(samples, share, self.cfg.micro_batch_tokens,
                                      shared_prefix=self.cfg.shared_prefix)) for share in shares if share)
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

    def save_state(self, path: Path) -> None:
        _ray().get([w.save_state.remote(path) for w in self.workers])

    def served_weights(self, *, merged: bool) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's weights, gathered by the workers and brought into this process through Ray's object
        store (memory; over the network from another node), for a publisher that sends them from memory."""
        gathered: dict[str, torch.Tensor] = _ray().get([w.served_weights.remote(merged) for w in self.workers])[0]
        return gathered.items()

    def logprobs(self, token_ids: list[int]) -> list[float]:
        ray = _ray()
        return ray.get([w.logprobs.remote(token_ids) for w in self.workers])[0]  # type: ignore[no-any-return]

    def weights(self) -> dict[str, Any]:
        """The full trainable weights, gathered (for tests and tools; the loop never needs them)."""
        ray = _ray()
        return ray.get([w.weights.remote() for w in self.workers])[0]  # type: ignore[no-any-return]

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        finally:
            self._release()

    def _release(self) -> None:
        """Kill the workers and free their placement group (on a shared Ray, the next backend needs its
        resources), then stop the Ray this backend started."""
        ray = _ray()
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
        if self.owns_ray:
            ray.shutdown()
