"""Which device and precision the trainer uses, and refusing combinations this machine cannot run.

`check_hardware` runs when the trainer's configuration loads (before Ray starts or a model loads), so
`device=cuda` on a machine without CUDA fails in a second with a sentence, not in a worker's traceback.
"""

from __future__ import annotations

import os

import torch

from tracetrain.config import TrainConfig, cuda_here


def resolve_device(cfg: TrainConfig) -> str:
    """`cpu` or `cuda` (`auto`: cuda when a CUDA device is visible)."""
    if cfg.device == "auto":  # a TrainConfig used on its own; a command settles it first (Config.settled)
        return "cuda" if cuda_here() else "cpu"
    return cfg.device


def local_device(cfg: TrainConfig) -> str:
    """The local backend's torch device: `cuda:N` for the first of `train.gpus` (the GPU plan's choice,
    engines/gpus.py), else `cuda` (the current device) or `cpu`."""
    device = resolve_device(cfg)
    return f"cuda:{cfg.gpus[0]}" if device == "cuda" and cfg.gpus else device


def trainer_visible_devices(cfg: TrainConfig) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for a local Ray that places the `fsdp` workers on `train.gpus` only (None:
    no GPUs named, or a cluster whose machines number their own GPUs)."""
    if not cfg.gpus or cfg.ray_address is not None:
        return None
    from tracetrain.engines.gpus import visible_gpus

    labels = visible_gpus()
    return ",".join(labels[g] for g in cfg.gpus)


def check_hardware(cfg: TrainConfig) -> None:
    """Raise ValueError naming the setting when this machine cannot train with `cfg`."""
    device = resolve_device(cfg)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda, but torch sees no CUDA device here (torch "
                         f"{torch.__version__}; a CPU-only build cannot use a GPU)")
    if cfg.uses_fsdp and cfg.ray_address is None:
        # on a Ray cluster the workers land on other machines, whose devices this one cannot count
        available = torch.cuda.device_count() if device == "cuda" else os.cpu_count() or 1
        unit = "CUDA devices" if device == "cuda" else "CPU cores"
        if cfg.workers > available:
            raise ValueError(f"train.workers={cfg.workers}, but this machine has {available} {unit}; "
                             "set train.ray_address to place workers on a cluster")
    if cfg.dtype == "bfloat16":
        if device == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"train.dtype=bfloat16, but {torch.cuda.get_device_name()} lacks bfloat16 "
                             "(Ampere or newer has it); use float32")
        if device == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            raise ValueError("train.dtype=bfloat16, but this CPU has no bfloat16 instructions (AVX512-BF16 or "
                             "AMX); use float32")


def autocast(cfg: TrainConfig, device: str) -> torch.autocast:
    """bfloat16 compute over float32 weights for the local backend (FSDP casts with its own policy)."""
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                          enabled=cfg.dtype == "bfloat16")


def compile_layers(model: torch.nn.Module) -> None:
    """`train.torch_compile`: compile each decoder layer's `forward`. Per layer, because the layers share
    one shape, so one compiled graph serves them all. Only `forward`, not the module's call: the hooks
    around it (FSDP's gathering, gradient checkpointing) stay eager, and parameter names and checkpoints
    stay those of the plain model. The head stays eager too, since it runs only where the mask is set, a
    shape that depends on the data (step.SampledLogits)."""
    for layer in model.get_decoder().layers:  # type: ignore[operator]
        layer.forward = torch.compile(layer.forward)


def release_cached_memory() -> None:
    """Hand the memory torch's allocator keeps cached after a step back to the GPU, so that a vLLM that
    slept through the step (`engine.sleep`) can wake into it. A no-op without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
