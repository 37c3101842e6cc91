"""The seam between the gateway and whatever generates tokens.

The gateway renders chat templates itself and hands engines token ids only, so every engine sees the
exact prompt the store records. An engine streams back sampled token ids with their logprobs; the
text it returns is for the client, the ids are for training.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineError(Exception):
    """The engine failed; `status` is the HTTP status the gateway should answer with."""

    def __init__(self, message: str, *, status: int = 502, code: str = "engine_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class EngineUnavailable(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=503, code="engine_unavailable")


class EngineTimeout(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=504, code="engine_timeout")


class EngineBusy(EngineError):
    """Every replica is at its bound of outstanding requests and the wait for room ran out: 429."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, status=429, code="engine_busy")
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


@dataclass(frozen=True)
class Affinity:
    """What a router needs to keep a session's calls on the replica holding its prefix."""

    session_id: str
    group_id: str | None = None
    """GRPO siblings share a prompt: a new session prefers the replica its group already uses."""


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    """How many alternatives per position the client asked for; the sampled token's logprob is
    always returned regardless."""
    stream: bool = True
    """Whether the caller uses deltas as they come. False lets an engine answer in one piece, which
    for an HTTP engine is one JSON body instead of an event per token."""
    structured_output: dict[str, Any] | None = None
    """A decoding constraint in vLLM's `structured_outputs` shape (`{"json": schema}`,
    `{"json_object": true}`); engines that cannot enforce it must refuse with a 400."""
    version: int | None = None
    """Serve these weights if the engine holds them (canary promotion keeps a session on the version
    it started with); otherwise, and when None, the engine's current version."""
    line: str | None = None
    """The named policy whose line serves it: that line's newest published version, its base model until
    then (docs/architecture.md, decision 13). None: the default line."""


@dataclass
class TokenDelta:
    """A slice of the generation. The last delta of a stream has `finish_reason` set."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    top_logprobs: list[dict[str, float]] | None = None
    """One dict (token text -> logprob) per token in `token_ids`, when asked for."""
    finish_reason: str | None = None
    version: int | None = None
    """The policy version whose weights produced these tokens, when the engine knows it exactly."""
    route: dict[str, str] | None = None
    """Which replica served the call and why (`{"replica": url, "route": reason}`), from a replica set."""


class Engine(Protocol):
    """Generates from token ids. `version` is the policy version whose weights are being served."""

    model_name: str

    @property
    def version(self) -> int: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]: ...

    async def close(self) -> None: ...
