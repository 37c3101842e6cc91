"""One training step on stored trajectories: advantages, then micro-batched forward/backward, one
optimizer step. Reads top to bottom like nanochat's RL script; the algorithms live in `algorithms/`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tracetrain.config import TrainConfig
from tracetrain.trainer.algorithms import verl_ops
from tracetrain.trainer.algorithms.baseline import RunningBaseline
from tracetrain.trainer.algorithms.dpo import dpo_loss, preference_pairs
from tracetrain.trainer.algorithms.importance import truncated_is_weights
from tracetrain.trainer.algorithms.sft import select_for_sft, sft_loss
from tracetrain.trainer.data import MicroBatch, Sample, collate, pack


@dataclass
class StepInputs:
    samples: list[Sample]
    advantages: list[float]
    """One scalar per sample (outcome rewards): broadcast over its sampled tokens."""


def sequence_logprobs(model: Any, micro: MicroBatch, *, entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each sampled target token under `model` (0 elsewhere), and optionally its entropy.

    The vocabulary projection runs only where the mask is 1: prompts are most of the tokens, and
    their logits (49k wide for SmolLM2) would be a fifth of the step's compute and most of its memory.
    """
    hidden = model.get_decoder()(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
    where = micro.mask > 0
    logits = model.get_output_embeddings()(hidden.last_hidden_state[:, :-1][where]).float()
    log_p = torch.log_softmax(logits, dim=-1)
    logprobs = torch.zeros_like(micro.mask, dtype=log_p.dtype)
    logprobs[where] = log_p.gather(-1, micro.targets[where].unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logprobs, None
    entropies = torch.zeros_like(logprobs)
    entropies[where] = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropies


def rl_advantages(samples: list[Sample], cfg: TrainConfig, baseline: RunningBaseline) -> list[float]:
    """Scalar advantage per sample: verl's estimator for real groups, the running baseline for singletons."""
    sizes: dict[str, int] = {}
    for s in samples:
        sizes[s.group_id] = sizes.get(s.group_id, 0) + 1
    singles = [i for i, s in enumerate(samples) if sizes[s.group_id] == 1]
    grouped = [i for i, s in enumerate(samples) if sizes[s.group_id] > 1]
    advantages = [0.0] * len(samples)
    for i in singles:
        advantages[i] = baseline.advantage(samples[i].group_id, samples[i].reward)
    if grouped:
        mask = torch.ones(len(grouped), 1)
        rewards = torch.tensor([samples[i].reward for i in grouped])
        values = verl_ops.compute_advantages(cfg.advantage, rewards, mask, [samples[i].group_id for i in grouped],
                                             gamma=cfg.gamma)
        for i, value in zip(grouped, values[:, 0].tolist(), strict=True):
            advantages[i] = value
        for i in grouped:  # groups also teach the baseline what rewards look like
            baseline.update(samples[i].group_id, samples[i].reward)
    return advantages


def train_step(model: Any, optimizer: torch.optim.Optimizer, inputs: StepInputs, cfg: TrainConfig, pad_id: int,
               reference: Any = None) -> dict[str, float]:
    started = time.perf_counter()
    samples = inputs.samples
    micro_batches = [collate(samples, idx, pad_id) for idx in
                     pack(list(range(len(samples))), [len(s.input_ids) for s in samples], cfg.micro_batch_tokens)]
    num_tokens = sum(int(mb.mask.sum()) for mb in micro_batches)
    config = verl_ops.actor_config(cfg.policy_loss, clip_ratio=cfg.clip_ratio, clip_ratio_low=cfg.clip_ratio_low,
                                   clip_ratio_high=cfg.clip_ratio_high, loss_agg_mode=cfg.loss_agg_mode,
                                   batch_num_tokens=num_tokens, global_batch_size=len(samples))
    model.train()
    old = [sequence_logprobs(model, mb)[0].detach() for mb in micro_batches] if cfg.ppo_epochs > 1 else None
    totals = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "is_weight": 0.0}
    for _epoch in range(cfg.ppo_epochs):
        for k, mb in enumerate(micro_batches):
            logprobs, entropies = sequence_logprobs(model, mb, entropy=cfg.entropy_coef > 0)
            old_logprobs = old[k] if old is not None else logprobs.detach()
            advantages = torch.tensor([inputs.advantages[i] for i in mb.indices]).unsqueeze(1) * mb.mask
            weights = truncated_is_weights(old_logprobs, mb.behaviour_logprobs, mb.mask, cfg.tis_cap) \
                if cfg.tis_cap else None
            loss, _ = verl_ops.policy_loss(cfg.policy_loss, old_logprobs, logprobs, advantages, mb.mask, config,
                                           weights)
            if cfg.kl_coef > 0 and reference is not None:
                with torch.no_grad():
                    ref_logprobs, _ = sequence_logprobs(reference, mb)
                kl = verl_ops.aggregate(verl_ops.kl_to_reference(logprobs, ref_logprobs, cfg.kl_type), mb.mask, config)
                loss = loss + cfg.kl_coef * kl
                totals["kl"] += float(kl)
            if entropies is not None:
                entropy = verl_ops.aggregate(entropies, mb.mask, config)
                loss = loss - cfg.entropy_coef * entropy
                totals["entropy"] += float(entropy) / cfg.ppo_epochs
            (loss / cfg.ppo_epochs).backward()
            totals["loss"] += float(loss.detach()) / cfg.ppo_epochs
            if weights is not None:
                totals["is_weight"] += float((weights * mb.mask).sum()) / max(num_tokens, 1) / cfg.ppo_epochs
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    total_tokens = sum(int(mb.attention_mask.sum()) for mb in micro_batches) * cfg.ppo_epochs
    return {**totals, "grad_norm": float(grad_norm), "trained_tokens": num_tokens, "step_seconds": elapsed,
            "tokens_per_second": total_tokens / elapsed, "micro_batches": len(micro_batches)}


def sft_step(model: Any, optimizer: torch.optim.Optimizer, samples: list[Sample], cfg: TrainConfig,
             pad_id: int) -> dict[str, float]:
    chosen = select_for_sft([s.reward for s in samples], cfg.sft_min_reward)
    if not chosen:
        return {"loss": 0.0, "trained_tokens": 0}
    micro_batches = [collate(samples, idx, pad_id) for idx in
                     pack(chosen, [len(s.input_ids) for s in samples], cfg.micro_batch_tokens)]
    num_tokens = sum(int(mb.mask.sum()) for mb in micro_batches)
    model.train()
    total = 0.0
    for mb in micro_batches:
        loss = sft_loss(sequence_logprobs(model, mb)[0], mb.mask, num_tokens)
        loss.backward()
        total += float(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "trained_tokens": num_tokens, "sft_samples": len(chosen)}


def dpo_step(model: Any, reference: Any, optimizer: torch.optim.Optimizer, samples: list[Sample],
             cfg: TrainConfig, pad_id: int) -> dict[str, float]:
    groups: dict[str, list[tuple[int, float]]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append((i, s.reward))
    pairs = preference_pairs(groups)
    if not pairs:
        return {"loss": 0.0, "pairs": 0}
    model.train()
    total = 0.0
    for chosen, rejected in pairs:
        mb = collate(samples, [chosen, rejected], pad_id)
        policy = (sequence_logprobs(model, mb)[0] * mb.mask).sum(-1)
        with torch.no_grad():
            ref = (sequence_logprobs(reference, mb)[0] * mb.mask).sum(-1)
        loss = dpo_loss(policy[:1], policy[1:], ref[:1], ref[1:], cfg.dpo_beta) / len(pairs)
        loss.backward()
        total += float(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "pairs": len(pairs)}
