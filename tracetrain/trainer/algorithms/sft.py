"""Supervised fine-tuning on selected trajectories (rejection-sampling fine-tuning: RAFT, Dong et al.
2023; ReST, Gulcehre et al. 2023): keep trajectories whose reward clears a threshold and maximise the
likelihood of their sampled tokens. Only tokens the model produced (loss mask 1) are trained on."""

from __future__ import annotations

import torch


def select_for_sft(rewards: list[float], min_reward: float) -> list[int]:
    """Indices of the trajectories worth imitating."""
    return [i for i, r in enumerate(rewards) if r >= min_reward]


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens. Pass `num_tokens` (the whole batch's masked
    token count) when the batch is split into micro-batches so that their losses add up to the mean."""
    total = mask.sum() if num_tokens is None else num_tokens
    return -(logprobs * mask).sum() / torch.clamp(torch.as_tensor(total, dtype=logprobs.dtype), min=1.0)
