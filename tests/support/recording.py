"""An engine wrapper that remembers what the real engine was given and what it sampled.

It wraps a real engine and changes nothing; tests use it to check the store against the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tracetrain.engines.base import Affinity, Engine, SamplingParams, TokenDelta


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class RecordingEngine:
    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.generations: list[Generation] = []

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        record = Generation(list(prompt_ids))
        self.generations.append(record)
        async for delta in self.inner.generate(prompt_ids, params, affinity):
            record.token_ids += delta.token_ids
            record.logprobs += delta.logprobs
            yield delta

    async def close(self) -> None:
        """The wrapped engine belongs to the test fixture that made it."""


def assert_one_exact_segment(trajectory: dict[str, Any], generations: list[Generation]) -> dict[str, Any]:
    """`trajectory` (one leaf of GET …/trajectory) is one segment whose ids are the last prompt the
    engine was given plus its sample, each prompt extending the previous prompt + sample, with a loss
    mask of 1 exactly on the sampled ids. Returns the segment."""
    for before, after in zip(generations, generations[1:], strict=False):
        chain = before.prompt_ids + before.token_ids
        assert after.prompt_ids[: len(chain)] == chain
    (segment,) = trajectory["segments"]
    assert segment["reason"] == "start" and len(segment["call_ids"]) == len(generations)
    assert segment["token_ids"] == generations[-1].prompt_ids + generations[-1].token_ids
    mask = [0] * len(segment["token_ids"])
    for gen in generations:
        mask[len(gen.prompt_ids): len(gen.prompt_ids) + len(gen.token_ids)] = [1] * len(gen.token_ids)
    assert segment["loss_mask"] == mask
    return segment  # type: ignore[no-any-return]


def trained_token_count(calls: list[dict[str, Any]]) -> int:
    """How many of the sampled tokens of `calls` (a session's calls as GET /v1/sessions/{id} gives them) a
    trajectory's loss mask must hold: all of them but those redaction masked. A model sampling at
    temperature may write a run of digits that reads as a card number or a key, and the default
    `gateway.redaction: redact` keeps such tokens out of the loss by design."""
    masked = sum(end - start for c in calls for start, end in (c["redactions"] or {}).get("completion", ()))
    return sum(c["completion_tokens"] for c in calls) - masked


def is_produced(token_ids: list[int], generations: list[Generation], filler: int) -> bool:
    """Whether `token_ids` (a stored segment) is some generation's prompt plus sample, token for token,
    but for tokens redaction stored as the `filler` id (`tracetrain.proxy.redact.filler_id`): a sampled
    run of digits may read as a phone number or a key, and the default `gateway.redaction: redact` keeps
    it out of the store by design."""
    return any(len(ids) == len(token_ids) and all(s in (p, filler) for s, p in zip(token_ids, ids, strict=True))
               for ids in (g.prompt_ids + g.token_ids for g in generations))
