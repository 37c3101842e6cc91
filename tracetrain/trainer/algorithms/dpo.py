"""Direct Preference Optimisation (Rafailov et al. 2023) from pairs formed out of stored groups.

Within a group (same prompt), the highest- and lowest-rewarded trajectories form a (chosen, rejected)
pair when their rewards differ. Sequence log-likelihoods are sums over sampled tokens only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def preference_pairs(groups: dict[str, list[tuple[int, float]]]) -> list[tuple[int, int]]:
    """(chosen, rejected) sample indices: best vs worst of each group whose rewards differ."""
    pairs = []
    for members in groups.values():
        best = max(members, key=lambda m: m[1])
        worst = min(members, key=lambda m: m[1])
        if best[1] > worst[1]:
            pairs.append((best[0], worst[0]))
    return pairs


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))); inputs are sequence
    log-likelihoods of shape (pairs,)."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin).mean()
