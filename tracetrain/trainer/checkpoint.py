"""Checkpoints: one directory per policy version, written atomically.

`v000007/` holds either a complete Hugging Face model (full fine-tuning; vLLM can reload it) or a
PEFT adapter (LoRA; vLLM can load it by name), plus `trainer_state.pt` with the optimizer, the
running baseline and the step, so a restarted trainer continues where it stopped.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracetrain.config import TrainConfig

STATE_FILE = "trainer_state.pt"


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def build_model(base_dir: Path, cfg: TrainConfig, resume_from: Path | None = None) -> torch.nn.Module:
    """The trainable policy: the base model, or base + LoRA adapter; from a checkpoint when resuming."""
    if not cfg.lora:
        source = resume_from if resume_from is not None else base_dir
        return AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    from peft import LoraConfig, PeftModel, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if resume_from is not None:
        return PeftModel.from_pretrained(base, str(resume_from), is_trainable=True)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(base, lora)


MERGED_DIR = "merged"
"""Inside a LoRA checkpoint: the adapter merged into the base weights, a complete model for engines
that serve full weights faster than adapters (vLLM on CPU: about twice as fast per token)."""


def save(root: Path, version: int, model: Any, tokenizer_dir: Path, state: dict[str, Any], keep: int,
         *, merged: bool = False) -> Path:
    """Write version `version` to a temporary directory, then rename it into place."""
    target = version_dir(root, version)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(tmp)
    if merged:
        _save_merged(model, tmp / MERGED_DIR)
        tokenizer.save_pretrained(tmp / MERGED_DIR)
    torch.save(state, tmp / STATE_FILE)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _prune(root, keep)
    return target


def _save_merged(model: Any, path: Path) -> None:
    model.merge_adapter()
    try:
        base = model.get_base_model()
        weights = {k: v for k, v in base.state_dict().items() if "lora_" not in k}
        clean = {k.replace(".base_layer.", "."): v.detach().clone() for k, v in weights.items()}
        if getattr(base.config, "tie_word_embeddings", False):
            clean.pop("lm_head.weight", None)  # stored once, as the embedding, like save_pretrained does
        base.save_pretrained(path, state_dict=clean, safe_serialization=True)
    finally:
        model.unmerge_adapter()


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, weights_only=False)  # type: ignore[no-any-return]


def _prune(root: Path, keep: int) -> None:
    versions = sorted(p for p in root.glob("v[0-9]*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
