"""Checkpoints: one directory per policy version, written atomically.

`v000007/` holds what an engine loads (a complete Hugging Face model for full fine-tuning, a PEFT
adapter for LoRA, and with `merged/` that adapter merged into the base weights), `sharded/` with the
trainable weights and the optimizer in `torch.distributed.checkpoint` form, which any number of
workers can load (it is resharded on load), and `trainer_state.pt` with the loop's own state (running
baseline, counts, version). A backend writes the engine's files and the sharded state
(trainer/local_backend.py, trainer/fsdp_worker.py); the loop writes the rest and renames the directory
into place.

The sharded state is only for resuming: nothing serves it. So it is written after the directory is in
place, by `write_state`, and the local backend writes it in the background from a snapshot, while the
next step gathers and trains. It goes into a staging directory beside the version's and is renamed into
it once complete, so a version holds its whole resume state or none; a trainer stopped in between resumes
from the version's engine files with fresh optimizer moments.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracetrain.config import TrainConfig

STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "sharded"
SINGLE_PROCESS_WARNING = "torch.distributed is .*single process"
STATE_STAGING = ".sharded.tmp"
"""Suffix of the directory beside a version's (`v000007.sharded.tmp`) that its sharded state is written into."""
MERGED_DIR = "merged"
"""Inside a LoRA checkpoint: the adapter merged into the base weights, a complete model for engines
that serve full weights faster than adapters (vLLM on CPU: about twice as fast per token)."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def build_model(base_dir: Path, cfg: TrainConfig, resume_from: Path | None = None) -> torch.nn.Module:
    """The trainable policy in float32: the base model, or base + LoRA adapter; from a checkpoint's
    engine files when `resume_from` is given (the sharded state is loaded separately)."""
    if not cfg.lora:
        source = resume_from if resume_from is not None else base_dir
        return AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, attn_implementation="sdpa")
    from peft import LoraConfig, PeftModel, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="sdpa")
    if resume_from is not None:
        return PeftModel.from_pretrained(base, str(resume_from), is_trainable=True)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=LORA_TARGETS)
    return get_peft_model(base, lora)


def save_version(root: Path, version: int, write: Callable[[Path], None], tokenizer_dir: Path,
                 state: dict[str, Any], keep: int, *, merged: bool, protect: Path | None = None) -> Path:
    """Have `write` fill a temporary directory (weights, sharded state), add the tokenizer and the
    loop's state, then rename it into place and prune old versions."""
    target = version_dir(root, version)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    tokenizer = _tokenizer(str(tokenizer_dir))
    tokenizer.save_pretrained(tmp)
    if merged:
        tokenizer.save_pretrained(tmp / MERGED_DIR)
    torch.save(state, tmp / STATE_FILE)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _prune(root, keep, protect)
    return target


@functools.cache
def _tokenizer(directory: str) -> Any:
    """Loaded once per trainer: every version carries the same tokenizer, and loading it took a large part
    of a small model's checkpoint (the step-time breakdown, `time_s.checkpoint`)."""
    return AutoTokenizer.from_pretrained(directory)


def save_weights(model: Any, path: Path, state_dict: dict[str, Any], cfg: TrainConfig, *,
                 merged: bool, adapter: str | None = None) -> None:
    """The engine's files from a complete (gathered) state dict: the model or the adapter, and with
    `merged` the adapter folded into the base weights. With `adapter`, that adapter only (a model holding
    several policies' adapters would write every one)."""
    selected = {"selected_adapters": [adapter]} if adapter is not None else {}
    model.save_pretrained(path, state_dict=state_dict, safe_serialization=True, **selected)
    if merged:
        weights = served_weights(model, state_dict, cfg, merged=True)
        model.get_base_model().save_pretrained(path / MERGED_DIR, state_dict=weights, safe_serialization=True)


def served_weights(model: Any, state_dict: dict[str, Any], cfg: TrainConfig, *,
                   merged: bool) -> dict[str, torch.Tensor]:
    """The weights the engine serves, from a complete (gathered) state dict and named as in the model files:
    the model's own, or with `merged` the adapter folded into the base weights."""
    if not merged:
        return dict(state_dict)
    weights = merge_lora(state_dict, cfg.lora_alpha / cfg.lora_rank)
    if getattr(model.get_base_model().config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # stored once, as the embedding, like save_pretrained does
    return weights


def save_adapter(model: Any, path: Path, adapter: str) -> None:
    """A named policy's adapter as a plain PEFT adapter directory (`adapter_config.json` and its weights at the
    top of `path`, as the default adapter's), loadable on the base model under any name."""
    inner = path / adapter  # where PEFT writes an adapter not named `default`
    model.save_pretrained(path, selected_adapters=[adapter], safe_serialization=True)
    for file in inner.iterdir():
        file.rename(path / file.name)
    inner.rmdir()


def merge_lora(state_dict: dict[str, Any], scale: float) -> dict[str, torch.Tensor]:
    """PEFT LoRA state (`…q_proj.base_layer.weight`, `…q_proj.lora_A.default.weight`, …) as plain model
    weights: W + scale · B·A for every adapted layer (PEFT's own merge, without its in-place editing)."""
    merged: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix("base_model.model.")
        if ".base_layer." in key:
            stem = key.split(".base_layer.")[0]
            down = state_dict.get(f"{stem}.lora_A.default.weight")
            up = state_dict.get(f"{stem}.lora_B.default.weight")
            name = name.replace(".base_layer.", ".")
            if key.endswith(".weight") and down is not None and up is not None:
                value = value + scale * (up.float() @ down.float()).to(value.dtype)
        merged[name] = value.detach().clone()
    return merged


def save_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Trainable weights and optimizer state, each worker writing its own shards (no gathering)."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _trainable_state(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path), no_dist=_single_process())


def start_sharded_save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Future[Any]:
    """`save_sharded` from a copy of the state taken now, written by a background thread
    (`torch.distributed.checkpoint.async_save`): the caller may change the weights as soon as it returns.
    The local backend's only: its single process has no collectives for the thread to race with."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _trainable_state(model, optimizer)
    _quiet_single_process_everywhere()
    pending = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path), no_dist=True)
    return cast("Future[Any]", pending)


def write_state(version: Path, start: Callable[[Path], Future[Any] | None]) -> Future[None]:
    """Have `start` write a version's sharded state into the staging directory beside `version`, at once
    (it returns None) or in the background (a future), and rename it to `version / SHARDED_DIR` when
    complete. The returned future is done once it is there, or carries the write's failure."""
    staging = version.with_name(version.name + STATE_STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    done: Future[None] = Future()

    def finish(written: Future[Any] | None) -> None:
        try:
            if written is not None:
                written.result()
            staging.rename(version / SHARDED_DIR)
        except BaseException as exc:  # surfaced by whoever waits on `done`
            done.set_exception(exc)
        else:
            done.set_result(None)

    pending = start(staging)
    if pending is None:
        finish(None)
    else:
        pending.add_done_callback(finish)
    return done


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load `save_sharded`'s state into this worker's shards, whatever the worker count that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_state, optim_state = _trainable_state(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    # fails on any trainable tensor the checkpoint lacks
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=_single_process())
    # not strict: the frozen base (LoRA) is not in the checkpoint; it comes from the base model
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def _trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], Any]:
    """The model's trainable tensors and the optimizer's state, as `torch.distributed.checkpoint` saves them.
    `ignore_frozen_params` alone keeps a frozen tied head: `lm_head.weight` shares the embedding's tensor, so
    it is no parameter name of its own and torch cannot tell it is frozen. Under LoRA on a tied model (the
    SmolLM2 family) that wrote the whole embedding into every version's state, several times the adapter and
    its optimizer state; the head is the base model's and comes from it on load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    # every name of a frozen tensor, tied ones included; compiled layers' names as the state dict spells them
    frozen = {name.replace("_orig_mod.", "") for name, p in model.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    return {name: t for name, t in model_state.items() if name not in frozen}, optim_state


ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size")
"""The config fields that must agree for a checkpoint's weights to fit a model."""


def architecture(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    return {k: config.get(k) for k in ARCHITECTURE}


def check_base(checkpoint_dir: Path, base_dir: Path) -> None:
    """Refuse to resume from a checkpoint of another model (the store's latest version was trained
    from a different `model` than this trainer's), naming both, before any weights load."""
    state = load_state(checkpoint_dir)
    trained = state.get("base_model")
    if trained is None and (checkpoint_dir / "config.json").exists():  # full weights from before the field
        trained = architecture(checkpoint_dir)
    ours = architecture(base_dir)
    if trained is not None and trained != ours:
        differs = {k: (trained.get(k), ours.get(k)) for k in ARCHITECTURE if trained.get(k) != ours.get(k)}
        raise ValueError(f"the store's latest version ({checkpoint_dir}) was trained from another model than "
                         f"{base_dir} ({', '.join(f'{k}: {a} there, {b} here' for k, (a, b) in differs.items())}); "
                         "train with that model, or on a fresh store and checkpoint directory")


def _single_process() -> bool:
    """The local backend: no process group, so the sharded state is written and read by this process."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """torch warns on every single-process save and load, which is what the local backend means to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def _quiet_single_process_everywhere() -> None:
    """The same warning from the background write's thread, where `_quiet_single_process` does not reach
    (warning filters are the process's, and a context that set them is left before the thread warns).
    Adding the same filter again replaces it, so calling this once per write keeps one."""
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, weights_only=False)  # type: ignore[no-any-return]


def _prune(root: Path, keep: int, protect: Path | None = None) -> None:
    """Delete all but the newest `keep` version directories, and never `protect` (the weights the trainer
    continues from: under canary promotion, rolled-back versions can be the newest ones)."""
    versions = sorted(p for p in root.glob("v[0-9]*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in versions[:-keep] if keep > 0 else []:
        if protect is None or old.resolve() != protect.resolve():
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(old.with_name(old.name + STATE_STAGING), ignore_errors=True)  # left by a stopped trainer
