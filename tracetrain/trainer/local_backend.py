"""The `local` backend: the model and optimizer in this process, on one device (the CPU by default)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import TrainConfig
from tracetrain.trainer import checkpoint, memory
from tracetrain.trainer.backend import StepBatch
from tracetrain.trainer.devices import autocast, compile_layers, local_device
from tracetrain.trainer.step import SampledLogits, StepInputs, dpo_step, sft_step, token_logprobs, train_step

log = logging.getLogger(__name__)


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
        else:  # a fresh start, or a checkpoint from before sharded state existed
            self.model = checkpoint.build_model(base_dir, cfg, resume).to(self.device)
            self.optimizer = self._optimizer()
            if resume is not None:
                self.optimizer.load_state_dict(checkpoint.load_state(resume)["optimizer"])
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.torch_compile:
            compile_layers(self.model)
        self.policy = SampledLogits(self.model)
        self.reference = self._reference(base_dir) if cfg.kl_coef > 0 or cfg.algorithm == "dpo" else None
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)

    def _optimizer(self) -> torch.optim.Optimizer:
        # fused: one kernel over all parameters; on CPU far faster than the default for-each path, which
        # matters for full fine-tuning (bench/trainer_throughput.py).
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr,
                                 weight_decay=self.cfg.weight_decay, fused=True)

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
        checkpoint.save_weights(self.model, path, self.model.state_dict(), self.cfg, merged=merged)
        checkpoint.save_sharded(path / checkpoint.SHARDED_DIR, self.model, self.optimizer)

    def logprobs(self, token_ids: list[int]) -> list[float]:
        with autocast(self.cfg, self.device):
            return token_logprobs(self.policy, token_ids)

    def close(self) -> None:
        return None
