"""From claimed sessions to training tensors: samples, groups, packing by token budget.

A sample is one trajectory segment: the exact token ids the engine saw and sampled, the loss mask (1
on sampled tokens), the behaviour logprobs and the policy version of every sampled token. Its reward
is the session's: the sum of session-level rewards plus per-call rewards discounted back to the
segment's first call; or, when an admin overrode it, the override, for every segment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
from sqlmodel import Session

from tracetrain.store import queries
from tracetrain.store.trajectory import session_trajectories


@dataclass
class Sample:
    session_id: str
    group_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    finished_at: datetime | None = None
    """When the session's final reward arrived (UTC)."""

    @property
    def oldest_version(self) -> int:
        sampled = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(sampled) if sampled else 0

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


def load_samples(db: Session, session_ids: list[str], *, gamma: float = 1.0) -> list[Sample]:
    samples = []
    for session_id in session_ids:
        session = queries.get_session(db, session_id=session_id)
        if session is None:
            continue
        calls = queries.session_calls(db, session_id=session_id)
        rewards = queries.session_rewards(db, session_id=session_id)
        outcome = sum(r.value for r in rewards if r.call_id is None)
        finished = session.updated_at if session.updated_at.tzinfo else session.updated_at.replace(tzinfo=UTC)
        per_call: dict[str, float] = {}
        for reward in rewards:
            if reward.call_id is not None:
                per_call[reward.call_id] = per_call.get(reward.call_id, 0.0) + reward.value
        for trajectory in session_trajectories(calls):
            for segment in trajectory["segments"]:
                if not any(segment["loss_mask"]):
                    continue
                turn_rewards = sum(gamma**turn * per_call.get(call_id, 0.0)
                                   for turn, call_id in enumerate(segment["call_ids"]))
                value = outcome + turn_rewards if session.reward_override is None else session.reward_override
                samples.append(Sample(session_id, session.group_id, segment["token_ids"], segment["loss_mask"],
                                      segment["logprobs"], segment["policy_versions"], value, finished))
    return samples


def zero_variance_groups(samples: list[Sample]) -> set[str]:
    """Groups of two or more samples whose rewards are all equal: no learning signal for group baselines."""
    rewards: dict[str, list[float]] = {}
    for sample in samples:
        rewards.setdefault(sample.group_id, []).append(sample.reward)
    return {g for g, rs in rewards.items() if len(rs) > 1 and max(rs) - min(rs) < 1e-9}


def common_prefix(rows: list[list[int]]) -> int:
    """How many leading tokens all of `rows` share (0 for fewer than two rows)."""
    if len(rows) < 2:
        return 0
    shortest = min(len(r) for r in rows)
    first = rows[0]
    for position in range(shortest):
        token = first[position]
        if any(r[position] != token for r in rows):
            return position
    return shortest


def pack(indices: list[int], lengths: list[int], token_budget: int, shared: int = 0) -> list[list[int]]:
    """Micro-batches of sample indices whose tokens computed fit `token_budget`: count x longest, or with
    `shared` leading tokens common to every sample (computed once, `train.shared_prefix`), shared +
    count x (longest - shared).

    Longest first, so similar lengths share a micro-batch and padding stays small; a sample longer
    than the budget gets a micro-batch of its own.
    """
    order = sorted(indices, key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and shared + (len(current) + 1) * (longest - shared) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def balance(lengths: list[int], parts: int) -> list[list[int]]:
    """Sample indices split into `parts` shares of nearly equal token count (longest first, each to the
    lightest share so far: the LPT rule, within 4/3 of the best split). Shares may be empty when there
    are fewer samples than parts."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        lightest = loads.index(min(loads))
        shares[lightest].append(i)
        loads[lightest] += lengths[i]
    return [sorted(share) for share in shares]


@dataclass
class MicroBatch:
    """Right-padded tensors. Targets are input_ids shifted left: position t predicts token t+1, so the
    mask and logprobs are aligned with targets (the loss mask shifted by one)."""

    indices: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    versions: torch.Tensor
    shared: int = 0
    """Leading positions where every row holds the same tokens (fewer than the width): the shared-prefix
    pass computes them once (trainer/step.py)."""

    def to(self, device: torch.device | str) -> MicroBatch:
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in (
            "input_ids", "attention_mask", "targets", "mask", "behaviour_logprobs", "versions")})


def collate(samples: list[Sample], indices: list[int], pad_id: int) -> MicroBatch:
    width = max(len(samples[i].input_ids) for i in indices)

    def padded(values: list[list[int]] | list[list[float]], fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(v) + [fill] * (width - len(v)) for v in values], dtype=dtype)

    chosen = [samples[i] for i in indices]
    ids = padded([s.input_ids for s in chosen], pad_id, torch.long)
    attention = padded([[1] * len(s.input_ids) for s in chosen], 0, torch.long)
    loss_mask = padded([s.loss_mask for s in chosen], 0, torch.float32)
    logprobs = padded([s.logprobs for s in chosen], 0.0, torch.float32)
    versions = padded([s.versions for s in chosen], -1, torch.long)
    shared = min(common_prefix([s.input_ids for s in chosen]), width - 1)
    return MicroBatch(indices, ids, attention, ids[:, 1:], loss_mask[:, 1:], logprobs[:, 1:], versions[:, 1:],
                      shared)


def pack_samples(samples: list[Sample], indices: list[int], token_budget: int, *, shared_prefix: bool
                  ) -> list[list[int]]:
    """`indices` packed for one worker's passes. With `shared_prefix` the budget counts the beginning all
    of them share once, as the passes compute it (each micro-batch shares at least that much)."""
    shared = common_prefix([samples[i].input_ids for i in indices]) if shared_prefix else 0
    return pack(indices, [len(s.input_ids) for s in samples], token_budget, shared)
