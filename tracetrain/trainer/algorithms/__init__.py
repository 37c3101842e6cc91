"""Advantage and loss functions on tensors.

verl's `core_algos` registries supply the RL estimators and policy losses (see `verl_ops`); this
package adds only what verl lacks: SFT and DPO on stored trajectories, a running baseline for groups
of one, and truncated importance sampling against recorded behaviour logprobs.
"""
