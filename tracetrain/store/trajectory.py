"""From stored calls to trajectories: token ids, loss mask, behaviour logprobs, versions, segments.

A session is a tree of calls; each leaf gives one trajectory (root-to-leaf path). Along a path, calls
linked by `extend`/`branch` share one token chain and form one segment; any other link starts a new
segment, whose reason is kept. Sampled tokens that redaction masked are out of the loss mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracetrain.store.codec import decode_floats, decode_ids
from tracetrain.store.models import CHAINED_LINKS, Call


def full_ids(call: Call, by_id: dict[str, Call]) -> list[int]:
    """The call's whole chain: every prompt and sampled token up to and including its reply."""
    parts: list[list[int]] = []
    node: Call | None = call
    while node is not None:
        parts.append(decode_ids(node.completion_ids))
        parts.append(decode_ids(node.prompt_ids))
        node = by_id.get(node.parent_id) if node.parent_id and node.link in CHAINED_LINKS else None
    return [token for part in reversed(parts) for token in part]


def sampled_mask(call: Call, n: int) -> list[int]:
    """1 on each sampled token but those redaction masked: the model is never trained to write them."""
    mask = [1] * n
    for start, end in (call.redactions or {}).get("completion", ()):
        mask[start:end] = [0] * (end - start)
    return mask


def chain_redacted(call: Call, by_id: dict[str, Call]) -> bool:
    """Whether any token of the call's whole chain was masked by redaction (stored as a filler id)."""
    node: Call | None = call
    while node is not None:
        if (node.redactions or {}).get("prompt") or (node.redactions or {}).get("completion"):
            return True
        node = by_id.get(node.parent_id) if node.parent_id and node.link in CHAINED_LINKS else None
    return False


def _path(leaf: Call, by_id: dict[str, Call]) -> list[Call]:
    path = []
    node: Call | None = leaf
    while node is not None:
        path.append(node)
        node = by_id.get(node.parent_id) if node.parent_id else None
    return path[::-1]


def _segments(path: list[Call]) -> list[dict[str, Any]]:
    segments: list[dict[str, Any]] = []
    for call in path:
        if call.link not in CHAINED_LINKS or not segments:
            segments.append(
                {"reason": call.link, "call_ids": [], "token_ids": [], "loss_mask": [],
                 "logprobs": [], "policy_versions": []}
            )
        seg = segments[-1]
        prompt = decode_ids(call.prompt_ids)
        sampled = decode_ids(call.completion_ids)
        seg["call_ids"].append(call.id)
        seg["token_ids"] += prompt + sampled
        seg["loss_mask"] += [0] * len(prompt) + sampled_mask(call, len(sampled))
        seg["logprobs"] += [0.0] * len(prompt) + decode_floats(call.completion_logprobs)
        seg["policy_versions"] += [-1] * len(prompt) + [call.policy_version] * len(sampled)
    return segments


def session_trajectories(calls: Sequence[Call]) -> list[dict[str, Any]]:
    """One trajectory per leaf of the session's call tree, oldest first."""
    by_id = {call.id: call for call in calls}
    parents = {call.parent_id for call in calls if call.parent_id}
    leaves = [call for call in calls if call.id not in parents]
    return [{"leaf_call_id": leaf.id, "segments": _segments(_path(leaf, by_id))} for leaf in leaves]
