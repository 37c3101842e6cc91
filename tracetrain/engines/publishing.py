"""What a publisher hands to an engine and how it checks it first: `Checkpoint`, `Publisher`, `PublishError`.

The trainer writes one directory per version: a complete Hugging Face model for full fine-tuning
(`config.json`, `*.safetensors`, tokenizer files), or a PEFT adapter for LoRA (`adapter_config.json`,
`adapter_model.safetensors`, from peft's `save_pretrained`). A `Publisher` makes an engine serve it
while agents keep running: `engines/vllm_publish.py` (LoRA load, in-place reload) and
`engines/transformers_publish.py` (in-process swap). Every publisher checks the checkpoint before
touching the engine (safetensors headers against the served model, no torch needed), and a failed
publish raises `PublishError` with the previous version still served.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from tracetrain.config import DEFAULT_POLICY

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


WeightSource = Callable[[], Iterable[tuple[str, Any]]]
"""A version's full weights (name, tensor) by the names its checkpoint's model files use, what `reload_weights`
would read from them, produced when a publisher asks: how a trainer in the publisher's process hands its
tensors over (engines/weight_transfer.py)."""


@dataclass(frozen=True)
class Checkpoint:
    """One trained version on disk: a full model directory or a PEFT LoRA adapter directory."""

    version: int
    path: Path
    kind: Literal["full", "lora"]
    line: str = DEFAULT_POLICY
    """The named policy whose line it continues; a named policy's versions are LoRA adapters on the base model."""
    weights: WeightSource | None = field(default=None, compare=False, repr=False)
    """The same full weights in the trainer's memory, when the trainer runs in the publisher's process: a
    publisher that can send them into the engine does so instead of having it read `path`
    (engines/weight_transfer.py)."""


class PublishError(Exception):
    """A checkpoint could not be published; the engine still serves the version it served before."""


class Publisher(Protocol):
    async def publish(self, checkpoint: Checkpoint) -> None: ...


class LinePublisher(Protocol):
    """A publisher that serves named policies' lines too (docs/architecture.md, decision 13): `publish_line`
    makes a named line's version serve the requests for that line (`SamplingParams.line`), leaving every
    other line as it was."""

    async def publish_line(self, checkpoint: Checkpoint) -> None: ...


def line_version(engine: Any, line: str) -> int:
    """The version of `line` an engine serves: 0 (its base model) until one is published, and the default
    line's for an engine that serves no named lines."""
    if line == DEFAULT_POLICY:
        return int(engine.version)
    versions = getattr(engine, "line_versions", None)
    return int(versions().get(line, 0)) if versions is not None else 0


class CanaryPublisher(Protocol):
    """A publisher that can serve a new version next to the current one of its line (canary promotion):
    `stage` makes it available to the line's requests that ask for it by version, `promote` makes it the
    line's for everyone, `retire` drops it (requests asking for it get the line's current version)."""

    async def stage(self, checkpoint: Checkpoint) -> None: ...

    async def promote(self, checkpoint: Checkpoint) -> None: ...

    async def retire(self, version: int, line: str = DEFAULT_POLICY) -> None: ...


# --- checkpoint checks (no torch needed) ---------------------------------------------------------------

TensorIndex = dict[str, tuple[int, ...]]
"""Tensor name -> shape, read from safetensors headers."""


def safetensors_shapes(file: Path) -> TensorIndex:
    """Names and shapes from a safetensors header, after checking the file holds all the bytes the
    header promises (a checkpoint still being written, or cut short, fails here, not inside vLLM)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise PublishError(f"{file} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise PublishError(f"{file} is truncated or not a safetensors file")
        try:
            header: dict[str, Any] = json.loads(f.read(header_len))
        except ValueError as exc:
            raise PublishError(f"{file} has an unreadable safetensors header") from exc
    header.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + header_len + end != size:
        raise PublishError(f"{file} is truncated: {size} bytes, the header describes {8 + header_len + end}")
    return {name: tuple(t["shape"]) for name, t in header.items()}


def model_shapes(model_dir: Path) -> TensorIndex:
    """Every tensor of a model directory, over all its safetensors shards."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise PublishError(f"no *.safetensors files in {model_dir}")
    index: TensorIndex = {}
    for file in files:
        index.update(safetensors_shapes(file))
    return index


def check_full_checkpoint(path: Path, reference: TensorIndex) -> None:
    """A full checkpoint must hold exactly the served model's tensors, with the same shapes: vLLM would
    keep the old values of missing tensors without failing, serving a mix of two versions."""
    if not path.is_dir():
        raise PublishError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").exists():
        raise PublishError(f"{path} has no config.json: not a full model checkpoint")
    shapes = model_shapes(path)
    missing = sorted(reference.keys() - shapes.keys())
    extra = sorted(shapes.keys() - reference.keys())
    wrong = sorted(k for k in reference.keys() & shapes.keys() if reference[k] != shapes[k])
    if missing or extra or wrong:
        raise PublishError(
            f"{path} does not match the served model: missing {missing[:3]}, unexpected {extra[:3]}, "
            f"wrong shapes {[(k, shapes[k], reference[k]) for k in wrong[:3]]}"
        )


def check_lora_checkpoint(path: Path) -> dict[str, Any]:
    """A PEFT LoRA adapter directory; returns its adapter config."""
    config_file = path / ADAPTER_CONFIG
    if not config_file.exists():
        raise PublishError(f"{path} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    try:
        config: dict[str, Any] = json.loads(config_file.read_text())
    except ValueError as exc:
        raise PublishError(f"{config_file} is not valid JSON") from exc
    if config.get("peft_type") != "LORA":
        raise PublishError(f"{path} is a {config.get('peft_type')!r} adapter, not LoRA")
    weights = [path / name for name in ADAPTER_WEIGHTS if (path / name).exists()]
    if not weights:
        raise PublishError(f"{path} has no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    if weights[0].suffix == ".safetensors":
        safetensors_shapes(weights[0])
    return config


def expect_kind(checkpoint: Checkpoint, kind: str, publisher: str) -> None:
    if checkpoint.kind != kind:
        raise PublishError(f"{publisher} publishes {kind} checkpoints, got a {checkpoint.kind} one "
                           f"(version {checkpoint.version} at {checkpoint.path})")


def check_weights(weights: list[tuple[str, Any]], reference: TensorIndex) -> None:
    """Weights sent from memory must be the served model's tensors, with the same shapes, as a checkpoint on
    disk must (`check_full_checkpoint`): vLLM would keep the old values of missing ones, and a wrong shape
    fails inside vLLM with the engine halfway through loading. A tied head (`lm_head.weight`, which model
    files leave out) may come along; vLLM skips it."""
    shapes = {name: tuple(tensor.shape) for name, tensor in weights}
    missing = sorted(reference.keys() - shapes.keys())
    extra = sorted(shapes.keys() - reference.keys() - {"lm_head.weight"})
    wrong = sorted(k for k in reference.keys() & shapes.keys() if reference[k] != shapes[k])
    if missing or extra or wrong:
        raise PublishError(f"the weights in memory do not match the served model: missing {missing[:3]}, "
                           f"unexpected {extra[:3]}, wrong shapes {[(k, shapes[k], reference[k]) for k in wrong[:3]]}")


def check_known(shapes: TensorIndex, reference: Mapping[str, tuple[int, ...]], path: Path) -> None:
    unknown = sorted(k for k in shapes if k not in reference or reference[k] != shapes[k])
    if unknown:
        raise PublishError(f"{path} does not fit the served model: unknown or wrong-shaped {unknown[:3]}")
