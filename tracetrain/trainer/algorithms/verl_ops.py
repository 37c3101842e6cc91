"""The glue to verl's algorithm registries: advantages, policy losses, KL and entropy by name.

Any estimator registered with `verl.trainer.ppo.core_algos.register_adv_est` and any loss registered
with `register_policy_loss` is selectable by name, the user's own included. Tensors are (batch, T)
over the whole packed sequence; `mask` is 1 on sampled tokens (the loss mask shifted to targets).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from tracetrain.config import TrainConfig

GROUP_ESTIMATORS = {"grpo", "rloo", "grpo_vectorized", "rloo_vectorized", "opo", "grpo_passk", "gpg", "gdpo"}
"""Estimators whose baseline comes from other samples of the same group: groups of one get the
running baseline instead, and groups whose rewards are all equal teach nothing."""


def outcome_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's token-level reward layout: each sequence's scalar reward on its last sampled token."""
    token_rewards = torch.zeros_like(mask, dtype=torch.float32)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_rewards[rows, last[rows]] = rewards[rows].float()
    return token_rewards


def compute_advantages(name: str, rewards: torch.Tensor, mask: torch.Tensor, groups: list[str],
                       *, norm_by_std: bool = True, gamma: float = 1.0) -> torch.Tensor:
    """Per-token advantages from verl's estimator `name` for scalar outcome rewards."""
    token_rewards = outcome_rewards(rewards, mask)
    fn = core_algos.get_adv_estimator_fn(name)
    kwargs: dict[str, Any] = {"token_level_rewards": token_rewards, "response_mask": mask.float(),
                              "index": np.array(groups, dtype=object)}
    if name == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = norm_by_std
    if name == "remax":
        # ReMax's baseline is the reward of a greedy rollout; with none recorded, the group mean
        # (without the sample itself is RLOO) stands in. Stated deviation.
        kwargs["reward_baselines"] = _group_means(rewards, groups)
    if name == "reinforce_plus_plus":
        kwargs["config"] = _AlgoConfigLike(gamma=gamma)
    advantages, _returns = fn(**kwargs)
    return advantages * mask


def _group_means(rewards: torch.Tensor, groups: list[str]) -> torch.Tensor:
    means = {g: rewards[[i for i, h in enumerate(groups) if h == g]].float().mean() for g in set(groups)}
    return torch.stack([means[g] for g in groups])


class _AlgoConfigLike(dict):  # type: ignore[type-arg]
    """verl's estimators read `config.gamma` or `config.get(...)`; a dict with attribute access does."""

    def __getattr__(self, key: str) -> Any:
        return self[key]


def actor_config(loss: str, *, clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None,
                 loss_agg_mode: str, batch_num_tokens: int, global_batch_size: int, dp_size: int = 1,
                 **extra: Any) -> ActorConfig:
    """The slice of verl's actor config its policy losses read; `global_batch_info` makes each
    micro-batch's loss a share of the whole batch's mean, so micro-batch gradients simply add up (and,
    scaled by `dp_size`, so that data-parallel workers' averaged gradients do too)."""
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio=clip_ratio, clip_ratio_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
                       clip_ratio_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
                       loss_agg_mode=loss_agg_mode, policy_loss=PolicyLossConfig(loss_mode=loss),
                       global_batch_info={"batch_num_tokens": batch_num_tokens, "dp_size": dp_size,
                                          "global_batch_size": global_batch_size}, **extra)


def policy_loss(name: str, old_logprobs: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, config: ActorConfig,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    fn = core_algos.get_policy_loss_fn(name)
    return fn(old_logprobs, logprobs, advantages, mask.float(), config.loss_agg_mode, config, is_weights)  # type: ignore[no-any-return]


def aggregate(values: torch.Tensor, mask: torch.Tensor, config: ActorConfig) -> torch.Tensor:
    return core_algos.agg_loss(values, mask.float(), config.loss_agg_mode, **config.global_batch_info)  # type: ignore[no-any-return]


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    return core_algos.kl_penalty(logprobs, ref_logprobs, kind)  # type: ignore[arg-type]



def check_names(cfg: TrainConfig) -> None:
    """Refuse unknown algorithm names before any model loads, naming what the registries hold. The
    modules in `cfg.plugins` are imported first: that is where users call `register_adv_est` and
    `register_policy_loss`."""
    for module in cfg.plugins:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"train.plugins: cannot import {module!r}: {exc}") from exc
    if cfg.algorithm != "rl":
        return
    known = {"train.advantage": (cfg.advantage, core_algos.ADV_ESTIMATOR_REGISTRY, "register_adv_est"),
             "train.policy_loss": (cfg.policy_loss, core_algos.POLICY_LOSS_REGISTRY, "register_policy_loss")}
    for field, (name, registry, register) in known.items():
        if name not in registry:
            raise ValueError(f"{field}: {name!r} is not registered with verl (known: {', '.join(sorted(registry))}); "
                             f"register your own with core_algos.{register} in a module listed in train.plugins")
    probe, mask = torch.zeros(1, 2), torch.ones(1, 2)
    try:  # verl's own functions decide what they accept
        core_algos.agg_loss(probe, mask, cfg.loss_agg_mode)
    except (NotImplementedError, ValueError) as exc:
        raise ValueError(f"train.loss_agg_mode: {cfg.loss_agg_mode!r} is not a verl aggregation mode "
                         "(token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm)") from exc
    if cfg.kl_coef > 0:
        try:
            core_algos.kl_penalty(probe, probe, cfg.kl_type)  # type: ignore[arg-type]
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(f"train.kl_type: {cfg.kl_type!r} is not a verl kl_penalty kind "
                             "(kl, abs, mse, low_var_kl, full; '+' for straight-through)") from exc
