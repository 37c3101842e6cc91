"""Memory figures per worker, logged with every version: what its parameters and optimizer state take
(its shard of them, under FSDP) and the process's peak."""

from __future__ import annotations

import resource
from typing import Any

import torch


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's own shard
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this worker's parameters (trainable and frozen) and optimizer state."""
    params = sum(_local_bytes(p) for p in model.parameters())
    optim = sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"param_bytes": params, "optimizer_bytes": optim}


def peak_bytes(device: str) -> int:
    """Peak device memory allocated on CUDA; peak resident memory of the process on CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def figures(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str) -> dict[str, Any]:
    return {**state_bytes(model, optimizer), "peak_bytes": peak_bytes(device)}
