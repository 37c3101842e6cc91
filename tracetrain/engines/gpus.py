"""Which GPUs this machine has, and how the engine's replicas and the trainer share them.

GPUs are numbered as CUDA numbers them in this process: positions in `CUDA_VISIBLE_DEVICES` when it
is set, else the driver's indices. Counting them asks `nvidia-smi`, not torch: a gateway installed
without torch must still place the vLLM servers it starts.

The split (docs/architecture.md, "GPUs"):
- every vLLM replica started here gets one GPU of `engine.gpus`;
- the trainer's `workers` get `trainer_gpus`;
- unset, the engine takes the first GPUs and the trainer the next ones; on one GPU they share it.

Sharing a GPU is colocation: in `sync` mode vLLM sleeps while the trainer steps, in `async` mode
the two split its memory. On a machine with several GPUs, overlapping sets in `async` mode are refused:
both would compute on the shared GPU at once, while disjoint GPUs were available.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

SYNC_SHARE = 0.6
"""vLLM's memory share on a GPU it shares with the trainer in `sync` mode. vLLM sleeps while the
trainer steps, so the step's activations use vLLM's share then; while vLLM serves, the trainer's
resident weights and optimizer state must fit in the rest."""
ASYNC_SHARE = 0.45
"""vLLM's memory share on a GPU it shares with the trainer in `async` mode: both run at once, so the
trainer's activations must fit beside vLLM's weights and KV cache."""
ALONE_SHARE = 0.9
"""vLLM's memory share on a GPU of its own (vLLM's own default)."""


@functools.cache
def _driver_gpus() -> tuple[str, ...]:
    """Indices of the GPUs the NVIDIA driver lists; none without `nvidia-smi`."""
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())


def visible_gpus() -> list[str]:
    """The GPUs this process may use, in CUDA's order, as a child's `CUDA_VISIBLE_DEVICES` names them."""
    driver = _driver_gpus()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(driver)
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    return entries[:len(driver)]  # CUDA ignores entries past the devices that exist


@dataclass(frozen=True)
class GPUPlan:
    engine: list[int]
    """GPU of each vLLM replica started here, by replica (empty: none started here, or no GPU)."""
    trainer: list[int]
    """GPU of each trainer worker (empty: the trainer computes on the CPU, or not on this machine)."""
    memory_share: float | None
    """vLLM's `--gpu-memory-utilization` (None: no GPU engine here)."""
    sleep: bool
    """vLLM sleeps (level 1) while a `sync`-mode step trains."""

    @property
    def shared(self) -> list[int]:
        return sorted(set(self.engine) & set(self.trainer))


def plan_gpus(*, visible: int, replicas: int, workers: int, engine_gpus: list[int], trainer_gpus: list[int],
              mode: str, memory_share: float | None, sleep: str) -> GPUPlan:
    """The split for `visible` GPUs, `replicas` vLLM servers started here and `workers` trainer processes
    on GPUs (0 when the trainer runs on the CPU or elsewhere). Raises ValueError with a sentence naming
    the settings when the split cannot work."""
    _check_listed("engine.gpus", engine_gpus, visible)
    _check_listed("train.gpus", trainer_gpus, visible)
    if visible == 0:
        if sleep == "on":
            raise ValueError("engine.sleep: on needs a GPU (vLLM's sleep mode exists on CUDA only), and none is "
                             "visible here")
        return GPUPlan([], [], None, False)
    if engine_gpus and len(engine_gpus) != replicas:
        raise ValueError(f"engine.gpus lists {len(engine_gpus)} GPU(s) for {replicas} vLLM replica(s) started here: "
                         "each replica takes one GPU of its own")
    if trainer_gpus and len(trainer_gpus) != workers:
        raise ValueError(f"train.gpus lists {len(trainer_gpus)} GPU(s) for train.workers={workers}: each worker "
                         "takes one GPU (set train.workers to match, or train.device: cpu)")
    if replicas > visible and not engine_gpus:
        raise ValueError(f"{replicas} vLLM replicas need a GPU each, and {visible} are visible here")
    engine = engine_gpus or list(range(replicas))
    trainer = trainer_gpus or _default_trainer_gpus(visible, engine, workers)
    shared = sorted(set(engine) & set(trainer))
    if shared and mode == "async" and visible > 1:
        raise ValueError(f"the engine and the trainer both use GPU {shared} in async mode, where both compute at "
                         "once; give them disjoint GPUs (engine.gpus, train.gpus), or use train.mode: sync, in which "
                         "vLLM sleeps while the trainer steps")
    if sleep == "on" and not (shared and mode == "sync"):
        raise ValueError("engine.sleep: on puts vLLM to sleep while a sync-mode step trains on its GPU; it needs "
                         "train.mode: sync and a GPU shared by the engine and the trainer")
    asleep = sleep == "on" or (sleep == "auto" and bool(shared) and mode == "sync")
    if memory_share is None and engine:
        memory_share = (SYNC_SHARE if mode == "sync" else ASYNC_SHARE) if shared else ALONE_SHARE
    return GPUPlan(engine, trainer, memory_share if engine else None, asleep)


def _check_listed(name: str, gpus: list[int], visible: int) -> None:
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"{name} names a GPU twice: {gpus}")
    if missing := [g for g in gpus if g >= visible]:
        raise ValueError(f"{name} names GPU {missing}, but {visible} GPU(s) are visible here "
                         "(numbered from 0, as CUDA_VISIBLE_DEVICES orders them)")


def _default_trainer_gpus(visible: int, engine: list[int], workers: int) -> list[int]:
    """The GPUs after the engine's; when too few are left, the first ones (shared with the engine)."""
    if workers == 0:
        return []
    free = [g for g in range(visible) if g not in engine]
    if len(free) >= workers:
        return free[:workers]
    if workers > visible:
        raise ValueError(f"train.workers={workers} needs a GPU each, and {visible} are visible here")
    return list(range(workers))
