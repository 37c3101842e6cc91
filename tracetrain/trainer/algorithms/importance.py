"""Off-policy corrections against the recorded behaviour logprobs.

Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; the truncation is Espeholt et al. 2018's V-trace idea): each sampled token
is weighted by min(pi_old / pi_behaviour, cap), where pi_behaviour is what the engine sampled with
(recorded by the gateway, possibly several versions old) and pi_old the trainer's policy at the start
of the step. It corrects both staleness and the engine/trainer numerical mismatch. Deviation: the
weight is detached, as a per-token loss weight, the way verl applies rollout correction weights.
"""

from __future__ import annotations

import torch


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float = 2.0) -> torch.Tensor:
    """min(exp(old - behaviour), cap) on masked tokens, 0 elsewhere; no gradient flows through it."""
    log_ratio = (old_logprobs - behaviour_logprobs).detach().clamp(max=20.0)
    return torch.exp(log_ratio).clamp(max=cap) * mask


def staleness_floor(current_version: int, max_staleness: int) -> int:
    """The oldest behaviour version still trained on once the policy is at `current_version`: samples
    from older versions are more than `max_staleness` steps off-policy (0: strictly on-policy)."""
    return current_version - max_staleness
