"""Finished, rewarded sessions written straight into a store, for trainer tests that need no engine."""

from __future__ import annotations

from sqlmodel import Session

from tracetrain.store.codec import encode_floats, encode_ids
from tracetrain.store.models import DEFAULT_POLICY, AgentSession, Call, Reward


def add_session(db: Session, sid: str, group: str, reward: float, version: int = 0, *,
                policy: str = DEFAULT_POLICY) -> None:
    """One session of one call of named policy `policy`: a 5-token prompt, 3 sampled tokens, a final reward.

    The second sampled token depends on `sid`, so sessions answer differently, as real ones do. Were they
    identical, a group's advantages (summing to zero) would cancel exactly, and a step would move the
    weights only as far as AdamW magnifies float noise."""
    answer = 29 + sum(map(ord, sid)) % 64
    db.add(AgentSession(id=sid, group_id=group, status="final", policy_version=version, reward=reward,
                        policy=policy))
    db.add(Call(id=f"{sid}-c", completion_id=f"chatcmpl-{sid}", session_id=sid, group_id=group, link="start",
                model="tiny", policy_version=version, state_hash=sid, prompt_ids=encode_ids([1, 4093, 198, 6004, 2]),
                completion_ids=encode_ids([28, answer, 2]), completion_logprobs=encode_floats([-10.8, -10.8, -10.8]),
                messages=[], response_message={}))
    db.add(Reward(session_id=sid, value=reward, final=True))
