"""An engine wrapper that remembers what the real engine was given and what it sampled.

It wraps a real engine and changes nothing; tests use it to check the store against the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tracetrain.engines.base import Engine, SamplingParams, TokenDelta


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

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        record = Generation(list(prompt_ids))
        self.generations.append(record)
        async for delta in self.inner.generate(prompt_ids, params):
            record.token_ids += delta.token_ids
            record.logprobs += delta.logprobs
            yield delta

    async def close(self) -> None:
        """The wrapped engine belongs to the test fixture that made it."""
