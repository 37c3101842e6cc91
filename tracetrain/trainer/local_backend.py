"""The `local` backend: the model and optimizer in this process, on one device (the CPU by default).

With named policies it holds one base model and one LoRA adapter per policy (PEFT's multi-adapter
model: `add_adapter`, `set_adapter`), each with its own optimizer over its own adapter's parameters, not
a model per policy. The default policy's adapter is PEFT's `default`, so its checkpoints are as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import DEFAULT_POLICY, TrainConfig
from tracetrain.trainer import checkpoint, memory
from tracetrain.trainer.backend import StepBatch
from tracetrain.trainer.devices import autocast, compile_layers, local_device
from tracetrain.trainer.step import SampledLogits, StepInputs, dpo_step, sft_step, token_logprobs, train_step

log = logging.getLogger(__name__)


def adapter_name(policy: str) -> str:
    """The PEFT adapter of a named policy: `policy-<name>` with ':' for '.' (a module name cannot hold a dot, and
    no policy name holds a ':'); the prefix keeps a short name such as `a` from being part of `lora_`, which PEFT
    warns may reinitialise the adapter's weights when loading. The default policy's is PEFT's `default`."""
    return policy if policy == DEFAULT_POLICY else "policy-" + policy.replace(".", ":")


class LocalBackend:
    def __init__(self, cfg: TrainConfig, base_dir: Path, resume: Path | None) -> None:
        self.cfg = cfg
        self.device = local_device(cfg)
        sharded = resume / checkpoint.SHARDED_DIR if resume is not None else None
        if sharded is not None and sharded.is_dir():
            # weights and optimizer from the sharded state, whichever backend and worker count wrote it
            self.model: Any = checkpoint.build_model(base_dir, cfg).to(self.device)
            self.optimizer = self._optimizer()
            checkpoint.load_sharded(sharded, self.model, self.optimizer)
        else:  # a fresh start, or a version without its sharded state
            self.model = checkpoint.build_model(base_dir, cfg, resume).to(self.device)
            self.optimizer = self._optimizer()
            if resume is not None:
                state = checkpoint.load_state(resume)
                if "optimizer" in state:  # written before the sharded state existed
                    self.optimizer.load_state_dict(state["optimizer"])
                else:  # the trainer stopped before the version's state was written (trainer/checkpoint.py)
                    log.warning("%s holds no optimizer state: its weights go on with fresh optimizer moments",
                                resume)
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.torch_compile:
            compile_layers(self.model)
        self.policy = SampledLogits(self.model)
        self.base_dir = base_dir
        self.reference = self._reference(base_dir) if cfg.kl_coef > 0 or cfg.algorithm == "dpo" else None
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.lines: dict[str, tuple[TrainConfig, torch.optim.Optimizer]] = {DEFAULT_POLICY: (cfg, self.optimizer)}
        """Each policy's settings and optimizer; `cfg` and `optimizer` are those of the line in use."""
        self.active = DEFAULT_POLICY

    def _optimizer(self, cfg: TrainConfig | None = None) -> torch.optim.Optimizer:
        cfg = cfg or self.cfg
        # fused: one kernel over all parameters; on CPU far faster than the default for-each path, which
        # matters for full fine-tuning (bench/trainer_throughput.py). Only the adapter in use requires grad.
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                 weight_decay=cfg.weight_decay, fused=True)

    def add_line(self, name: str, cfg: TrainConfig, resume: Path | None) -> None:
        from peft import LoraConfig

        if not self.cfg.lora:
            raise ValueError("named policies are LoRA adapters on the base model; this trainer trains full weights")
        sharded = resume / checkpoint.SHARDED_DIR if resume is not None else None
        if resume is not None and not (sharded is not None and sharded.is_dir()):
            self.model.load_adapter(str(resume), adapter_name=adapter_name(name), is_trainable=True)
        else:
            lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                              target_modules=checkpoint.LORA_TARGETS)
            self.model.add_adapter(adapter_name(name), lora)
        self.model.set_adapter(adapter_name(name))  # marks this adapter's parameters, and only them, trainable
        optimizer = self._optimizer(cfg)
        if sharded is not None and sharded.is_dir():
            checkpoint.load_sharded(sharded, self.model, optimizer)
        self.lines[name] = (cfg, optimizer)
        if self.reference is None and (cfg.kl_coef > 0 or cfg.algorithm == "dpo"):
            self.reference = self._reference(self.base_dir)
        self.use_line(self.active)

    def use_line(self, name: str) -> None:
        self.cfg, self.optimizer = self.lines[name]
        if len(self.lines) > 1:
            self.model.set_adapter(adapter_name(name))
        self.active = name

    def _reference(self, base_dir: Path) -> SampledLogits:
        from transformers import AutoModelForCausalLM

        reference: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        return SampledLogits(reference.to(self.device)).eval().requires_grad_(False)

    def step(self, batch: StepBatch) -> dict[str, Any]:
        with autocast(self.cfg, self.device):
            if self.cfg.algorithm == "sft":
                figures = sft_step(self.policy, self.optimizer, batch.samples, self.cfg, self.pad_id)
            elif self.cfg.algorithm == "dpo":
                figures = dpo_step(self.policy, self.reference, self.optimizer, batch.samples, self.cfg, self.pad_id)
            else:
                assert batch.advantages is not None, "rl needs advantages"
                figures = train_step(self.policy, self.optimizer, StepInputs(batch.samples, batch.advantages),
                                     self.cfg, self.pad_id, self.reference)
        return {**figures, "workers": 1, "memory": [memory.figures(self.model, self.optimizer, self.device)]}

    def save(self, path: Path, *, merged: bool) -> None:
        if self.active == DEFAULT_POLICY:
            checkpoint.save_weights(self.model, path, self.model.state_dict(), self.cfg, merged=merged,
                                    adapter=DEFAULT_POLICY if len(self.lines) > 1 else None)
        else:
            checkpoint.save_adapter(self.model, path, adapter_name(self.active))

    def save_state(self, path: Path) -> Future[Any] | None:
        """In the background unless configured otherwise: nothing serves this state, so the next step need
        not wait for it."""
        if not self.cfg.state_in_background:
            checkpoint.save_sharded(path, self.model, self.optimizer)
            return None
        return checkpoint.start_sharded_save(path, self.model, self.optimizer)

    def served_weights(self, *, merged: bool) -> Iterable[tuple[str, torch.Tensor]]:
        return checkpoint.served_weights(self.model, self.model.state_dict(), self.cfg, merged=merged).items()

    def logprobs(self, token_ids: list[int]) -> list[float]:
        with autocast(self.cfg, self.device):
            return token_logprobs(self.policy, token_ids)

    def close(self) -> None:
        return None
