"""Where a training step runs: the seam between the learning loop and the hardware.

The loop (trainer/loop.py) gathers batches, computes advantages, checkpoints and records versions; a
backend owns the model and the optimizer, runs one optimizer step on a batch, and writes weights.
Both backends run the same step (trainer/step.py) with the same verl losses:

- `local` (trainer/local_backend.py): this process, one device: the CPU demo's backend.
- `fsdp` (trainer/fsdp_backend.py): torch FSDP2 over Ray actors, one per device.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tracetrain.config import TrainConfig
from tracetrain.trainer.data import Sample

if TYPE_CHECKING:
    import torch


@dataclass
class StepBatch:
    samples: list[Sample]
    advantages: list[float] | None = None
    """One scalar per sample for `rl`; None for `sft` and `dpo`."""


class TrainerBackend(Protocol):
    def step(self, batch: StepBatch) -> dict[str, Any]:
        """One optimizer step on `batch`; the step's figures (loss, grad_norm, tokens/s, peak memory …)."""
        ...

    def save(self, path: Path, *, merged: bool) -> None:
        """Write the engine's files into the directory `path`."""
        ...

    def save_state(self, path: Path) -> Future[Any] | None:
        """Write the sharded training state (trainable weights, optimizer) into the directory `path`: at once
        (None), or from a copy taken now by a background write, done when the returned future is."""
        ...

    def logprobs(self, token_ids: list[int]) -> list[float]:
        """The current weights' logprob of each token after the first (the publish probe, engines/probe.py)."""
        ...

    def close(self) -> None:
        """Free the devices and processes (a no-op for `local`)."""
        ...


@runtime_checkable
class WeightsInMemory(Protocol):
    """A backend that can hand its weights to this process without disk (the local backend holds them; the
    fsdp backend gathers them from its workers): a publisher here can send them into the engine from memory
    instead of having it read the checkpoint (engines/weight_transfer.py)."""

    def served_weights(self, *, merged: bool) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights the engine serves, named as in the checkpoint's model files: the model's, or with
        `merged` the default adapter folded into the base weights."""
        ...


@runtime_checkable
class MultiLineBackend(Protocol):
    """A backend that trains several named policies on one base model: an adapter and an optimizer each
    (the local backend; docs/architecture.md, decision 13). `step`, `save` and `logprobs` act on the line
    `use_line` chose last; the default policy's is there from the start."""

    def add_line(self, name: str, cfg: TrainConfig, resume: Path | None) -> None:
        """A named policy's adapter, from checkpoint `resume` or fresh, with its own optimizer and settings."""
        ...

    def use_line(self, name: str) -> None: ...


def make_backend(cfg: TrainConfig, base_dir: Path, resume: Path | None) -> TrainerBackend:
    """The backend `cfg` names, with its model built from `base_dir` or resumed from checkpoint `resume`."""
    if cfg.uses_fsdp:
        from tracetrain.trainer.fsdp_backend import FSDPBackend

        return FSDPBackend(cfg, base_dir, resume)
    from tracetrain.trainer.local_backend import LocalBackend

    return LocalBackend(cfg, base_dir, resume)
