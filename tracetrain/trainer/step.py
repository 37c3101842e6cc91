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
from tracetrain.trainer.data import MicroBatch, Sample, collate, pack_samples, zero_variance_groups


@dataclass
class StepInputs:
    samples: list[Sample]
    advantages: list[float]
    """One scalar per sample (outcome rewards): broadcast over its sampled tokens."""


@dataclass
class BatchShare:
    """This worker's part of a batch split over data-parallel workers (trainer/fsdp_backend.py).

    Losses are normalised by the whole batch's tokens and samples and scaled by `dp_size`, so that
    FSDP's gradient average over workers equals the gradient of the whole batch (verl's `dp_size`
    argument to `agg_loss` does this). Every worker runs `micro_batches` forward/backward passes, the
    same number, because each pass gathers parameters collectively; a worker with fewer micro-batches
    repeats its last one with weight 0 (and a worker with no samples at all trains on a borrowed one
    with weight 0: `live` False)."""

    num_tokens: int
    num_samples: int
    dp_size: int
    micro_batches: int
    live: bool = True


class SampledLogits(torch.nn.Module):
    """A causal LM's logits at the positions whose next token was sampled, and nowhere else.

    The vocabulary projection runs only where the mask is 1: prompts are most of the tokens, and
    their logits (49k wide for SmolLM2) would be a fifth of the step's compute and most of its memory.
    It is a module, and every pass goes through its `forward`, because FSDP gathers the root's
    parameters (embeddings, final norm, head) in hooks on the root module's forward."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, where: torch.Tensor,
                shared: int = 0) -> torch.Tensor:
        """`shared`: leading positions identical in every row, run once (`shared_hidden`); 0 runs every row
        whole."""
        decoder = self.model.get_decoder()
        if shared > 0 and len(input_ids) > 1:
            hidden = shared_hidden(decoder, input_ids, attention_mask, shared)
        else:
            # no KV cache: nothing reads it here, and filling it guards compiled layers on their index
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.model.get_output_embeddings()(hidden[:, :-1][where])  # type: ignore[no-any-return]


def shared_hidden(decoder: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, shared: int) -> torch.Tensor:
    """The decoder's hidden states for right-padded rows whose first `shared` tokens are the same, with
    those tokens run once: one row's prefix pass fills a KV cache, which every row then continues from.
    Gradients of the shared positions' keys and values sum over the rows back through the one pass, so
    the result equals the plain pass (`use_cache=False` on the whole rows) up to float rounding
    (tests/unit/test_shared_prefix.py compares the two)."""
    rows = len(input_ids)
    prefix = decoder(input_ids=input_ids[:1, :shared], use_cache=True)
    cache = prefix.past_key_values
    cache.batch_repeat_interleave(rows)
    rest = decoder(input_ids=input_ids[:, shared:], attention_mask=attention_mask, past_key_values=cache,
                   use_cache=True)
    return torch.cat([prefix.last_hidden_state.expand(rows, -1, -1), rest.last_hidden_state], dim=1)


@torch.no_grad()
def token_logprobs(policy: SampledLogits, token_ids: list[int]) -> list[float]:
    """Logprob of each token after the first in one sequence, in eval mode: what the publish probe compares
    with the engine's (engines/probe.py)."""
    training = policy.training
    policy.eval()
    try:
        device = next(policy.parameters()).device
        ids = torch.tensor([token_ids], device=device)
        where = torch.ones(1, len(token_ids) - 1, dtype=torch.bool, device=device)
        logits = policy(ids, torch.ones_like(ids), where).float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()  # type: ignore[no-any-return]
    finally:
        policy.train(training)


def sequence_logprobs(policy: SampledLogits, micro: MicroBatch, *, entropy: bool = False,
                      shared_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each sampled target token under `policy` (0 elsewhere), and optionally its entropy.
    `shared_prefix`: run the micro-batch's common beginning once (`train.shared_prefix`)."""
    where = micro.mask > 0
    shared = micro.shared if shared_prefix else 0
    log_p = torch.log_softmax(policy(micro.input_ids, micro.attention_mask, where, shared).float(), dim=-1)
    logprobs = torch.zeros_like(micro.mask, dtype=log_p.dtype)
    logprobs[where] = log_p.gather(-1, micro.targets[where].unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logprobs, None
    entropies = torch.zeros_like(logprobs)
    entropies[where] = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropies


def rl_advantages(samples: list[Sample], cfg: TrainConfig, baseline: RunningBaseline) -> list[float]:
    """Scalar advantage per sample: verl's estimator for real groups, the running baseline for singletons
    and, with `flat_groups: baseline`, for groups whose rewards are all equal."""
    members: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        members.setdefault(s.group_id, []).append(i)
    flat = zero_variance_groups(samples) if (cfg.flat_groups == "baseline"
                                             and cfg.advantage in verl_ops.GROUP_ESTIMATORS) else set()
    advantages = [0.0] * len(samples)
    grouped: list[int] = []
    for group, indices in members.items():
        if len(indices) == 1:
            advantages[indices[0]] = baseline.advantage(group, samples[indices[0]].reward)
        elif group in flat:
            against = baseline.flat_group(group, [samples[i].reward for i in indices])
            for i, value in zip(indices, against, strict=True):
                advantages[i] = value
        else:
            grouped += indices
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


def train_step(model: SampledLogits, optimizer: torch.optim.Optimizer, inputs: StepInputs, cfg: TrainConfig,
               pad_id: int, reference: SampledLogits | None = None, share: BatchShare | None = None
               ) -> dict[str, float]:
    started = time.perf_counter()
    samples, shared = inputs.samples, cfg.shared_prefix
    device = next(model.parameters()).device
    micro_batches = [collate(samples, idx, pad_id).to(device) for idx in
                     pack_samples(samples, list(range(len(samples))), cfg.micro_batch_tokens, shared_prefix=shared)]
    num_tokens = sum(int(mb.mask.sum()) for mb in micro_batches)
    share = share or BatchShare(num_tokens, len(samples), 1, len(micro_batches))
    # weight 0: a pass that only keeps this worker in step with the others' collectives
    weights = [1.0 if share.live else 0.0] * len(micro_batches) + [0.0] * (share.micro_batches - len(micro_batches))
    micro_batches += [micro_batches[-1]] * (share.micro_batches - len(micro_batches))
    config = verl_ops.actor_config(cfg.policy_loss, clip_ratio=cfg.clip_ratio, clip_ratio_low=cfg.clip_ratio_low,
                                   clip_ratio_high=cfg.clip_ratio_high, loss_agg_mode=cfg.loss_agg_mode,
                                   batch_num_tokens=share.num_tokens, global_batch_size=share.num_samples,
                                   dp_size=share.dp_size)
    model.train()
    old = [sequence_logprobs(model, mb, shared_prefix=shared)[0].detach() for mb in micro_batches] \
        if cfg.ppo_epochs > 1 else None
    totals = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "is_weight": 0.0}
    clipped: float | None = None
    """Share of sampled tokens whose importance ratio the policy loss clipped (when the loss reports it)."""
    for _epoch in range(cfg.ppo_epochs):
        for k, (mb, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            logprobs, entropies = sequence_logprobs(model, mb, entropy=cfg.entropy_coef > 0, shared_prefix=shared)
            old_logprobs = old[k] if old is not None else logprobs.detach()
            advantages = torch.tensor([inputs.advantages[i] for i in mb.indices], device=device).unsqueeze(1) * mb.mask
            is_weights = truncated_is_weights(old_logprobs, mb.behaviour_logprobs, mb.mask, cfg.tis_cap) \
                if cfg.tis_cap else None
            loss, loss_figures = verl_ops.policy_loss(cfg.policy_loss, old_logprobs, logprobs, advantages, mb.mask,
                                                      config, is_weights)
            if "actor/pg_clipfrac" in loss_figures:
                clipped = (clipped or 0.0) + weight * float(loss_figures["actor/pg_clipfrac"]) * float(mb.mask.sum()) \
                    / max(share.num_tokens, 1) / cfg.ppo_epochs
            if cfg.kl_coef > 0 and reference is not None:
                with torch.no_grad():
                    ref_logprobs, _ = sequence_logprobs(reference, mb, shared_prefix=shared)
                kl = verl_ops.aggregate(verl_ops.kl_to_reference(logprobs, ref_logprobs, cfg.kl_type), mb.mask, config)
                loss = loss + cfg.kl_coef * kl
                totals["kl"] += weight * float(kl.detach()) / share.dp_size
            if entropies is not None:
                entropy = verl_ops.aggregate(entropies, mb.mask, config)
                loss = loss - cfg.entropy_coef * entropy
                totals["entropy"] += weight * float(entropy.detach()) / cfg.ppo_epochs / share.dp_size
            (weight * loss / cfg.ppo_epochs).backward()
            totals["loss"] += weight * float(loss.detach()) / cfg.ppo_epochs / share.dp_size
            if is_weights is not None:
                totals["is_weight"] += weight * float((is_weights * mb.mask).sum()) / max(share.num_tokens, 1) \
                    / cfg.ppo_epochs
    passes_done = _synchronized(device)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = _synchronized(device) - started
    total_tokens = sum(int(mb.attention_mask.sum()) for mb, w in zip(micro_batches, weights, strict=True) if w) \
        * cfg.ppo_epochs
    if clipped is not None:
        totals["clip_fraction"] = clipped
    return {**totals, "grad_norm": float(_full(grad_norm)), "trained_tokens": num_tokens if share.live else 0,
            "step_seconds": elapsed, "tokens_per_second": total_tokens / elapsed, "micro_batches": len(micro_batches),
            "forward_backward_seconds": passes_done - started, "optimizer_seconds": started + elapsed - passes_done}


def _synchronized(device: torch.device) -> float:
    """A clock reading once the device has finished its queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's sharded grad norm) as a plain tensor."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def sft_step(model: SampledLogits, optimizer: torch.optim.Optimizer, samples: list[Sample], cfg: TrainConfig,
             pad_id: int) -> dict[str, float]:
    chosen = select_for_sft([s.reward for s in samples], cfg.sft_min_reward)
    if not chosen:
        return {"loss": 0.0, "trained_tokens": 0}
    device = next(model.parameters()).device
    micro_batches = [collate(samples, idx, pad_id).to(device) for idx in
                     pack_samples(samples, chosen, cfg.micro_batch_tokens, shared_prefix=cfg.shared_prefix)]
    num_tokens = sum(int(mb.mask.sum()) for mb in micro_batches)
    model.train()
    total = 0.0
    for mb in micro_batches:
        loss = sft_loss(sequence_logprobs(model, mb, shared_prefix=cfg.shared_prefix)[0], mb.mask, num_tokens)
        loss.backward()
        total += float(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "trained_tokens": num_tokens, "sft_samples": len(chosen)}


def dpo_step(model: SampledLogits, reference: SampledLogits | None, optimizer: torch.optim.Optimizer,
             samples: list[Sample], cfg: TrainConfig, pad_id: int) -> dict[str, float]:
    assert reference is not None, "dpo compares against the reference model"
    groups: dict[str, list[tuple[int, float]]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append((i, s.reward))
    pairs = preference_pairs(groups)
    if not pairs:
        return {"loss": 0.0, "pairs": 0}
    model.train()
    total = 0.0
    for chosen, rejected in pairs:
        mb = collate(samples, [chosen, rejected], pad_id).to(next(model.parameters()).device)
        policy = (sequence_logprobs(model, mb, shared_prefix=cfg.shared_prefix)[0] * mb.mask).sum(-1)
        with torch.no_grad():
            ref = (sequence_logprobs(reference, mb, shared_prefix=cfg.shared_prefix)[0] * mb.mask).sum(-1)
        loss = dpo_loss(policy[:1], policy[1:], ref[:1], ref[1:], cfg.dpo_beta) / len(pairs)
        loss.backward()
        total += float(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "pairs": len(pairs)}
