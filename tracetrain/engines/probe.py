"""Proving that a replica serves the weights the trainer wrote, before it serves them to anyone.

The trainer scores a fixed sequence of tokens with the new weights and writes the logprobs into the
checkpoint it publishes (`probe.json`, next to the weights or adapter). After loading a version, the
publisher asks the replica to score the same tokens (under the adapter's name for LoRA) and compares.
Each scored position is a one-token generation request forced to the probe's next token
(`allowed_token_ids`), whose logprob vLLM reports from the model's raw logits: the generation path, not
`prompt_logprobs`, because vLLM maps LoRA adapters to prompt logprobs per sequence instead of per token
when other adapters share the batch (vLLM issue #16668): the scores come out wrong, and vLLM's CPU build
dies of it, which a publish beside other policies' traffic would otherwise trigger.

A replica whose logprobs differ by more than the tolerance for the dtype it serves is not switched to the
version, and the reason is recorded in the replica's events and on the version's row. It is taken out of
routing when other replicas took the version; when none did, every replica keeps its previous adapter
(engines/replica_publish.py). This catches swaps that silently keep the
old adapter or the base model, a known failure of peer systems.

The comparison is the mean absolute difference over the scored tokens, so one token with an unlucky
rounding does not fail a probe, while a wrong adapter moves every token. `TOLERANCE` holds the bound
per dtype the engine serves in; the same weights scored by torch and by vLLM differ by rounding only.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tracetrain.engines.vllm_server import async_http_client

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tracetrain.engines.vllm import VLLMEngine

PROBE_FILE = "probe.json"

PROBE_TEXT = ("Probe of the served weights. The quick brown fox jumps over the lazy dog; 2, 3, 5, 7, 11, 13. "
              "def double(x):\n    return 2 * x\n")
"""Scored by the trainer and by every replica: prose, numbers and code, so every layer's weights count."""

TOLERANCE = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 5e-2}
"""Largest mean |logprob difference| between the trainer's scores and a replica's on the same weights,
by the dtype the replica serves. Rounding alone: float32 agrees to about 1e-4 per token (vLLM on CPU
against transformers, tests/integration/test_publish.py); 16-bit formats keep 8 (bfloat16) or 11
(float16) bits of mantissa, hence the wider bounds."""


PROBE_LENGTH = 48
"""Tokens in a probe drawn from the vocabulary (`probe_token_ids`, for tokenizers that do not know the text)."""


def probe_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens every checkpoint's probe scores: PROBE_TEXT, unless the tokenizer maps it to only a few
    distinct tokens (a small word-level vocabulary turns it into one unknown token, over and over). Such a
    probe scores one token the policy never emits, whose logit training drives far down, where a 16-bit
    format's rounding is largest: on a GPU in bfloat16 it missed its tolerance on the right weights. Then
    the probe is a fixed draw of ordinary (non-special) tokens of the vocabulary instead."""
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if len(set(ids)) >= PROBE_POSITIONS:
        return list(ids)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    if len(ordinary) < 2:
        raise ValueError(f"a probe needs a vocabulary of at least two ordinary tokens, not {len(ordinary)}")
    draw = random.Random(0)
    return [draw.choice(ordinary) for _ in range(PROBE_LENGTH)]


@dataclass(frozen=True)
class Probe:
    token_ids: list[int]
    logprobs: list[float]
    """Logprob of `token_ids[i + 1]` given the tokens before it, as the trainer computed it."""
    dtype: str
    """What the trainer computed in (its `train.dtype`)."""


@dataclass(frozen=True)
class ProbeResult:
    mean_diff: float
    max_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.mean_diff <= self.tolerance

    def describe(self) -> str:
        verdict = "matches" if self.ok else "does not match"
        return (f"probe {verdict} the trainer's logprobs: mean |diff| {self.mean_diff:.2e}, max {self.max_diff:.2e}, "
                f"tolerance {self.tolerance:.0e}")


def write_probe(directory: Path, probe: Probe) -> None:
    (directory / PROBE_FILE).write_text(json.dumps(asdict(probe)))


def read_probe(directory: Path) -> Probe | None:
    """The checkpoint's probe; None for a checkpoint written without one (an older trainer, a tool)."""
    path = directory / PROBE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Probe(list(data["token_ids"]), [float(x) for x in data["logprobs"]], str(data["dtype"]))


def compare(expected: list[float], served: list[float], tolerance: float) -> ProbeResult:
    if len(expected) != len(served) or not expected:
        raise ValueError(f"the probe scored {len(served)} tokens, the trainer {len(expected)}")
    diffs = [abs(a - b) for a, b in zip(expected, served, strict=True)]
    return ProbeResult(sum(diffs) / len(diffs), max(diffs), tolerance)


PROBE_POSITIONS = 16
"""Positions of the probe each replica scores, spread over the whole sequence: a wrong adapter or stale
weights move every token, so a handful of positions shows them as well as all of them would."""


def probe_positions(length: int, count: int = PROBE_POSITIONS) -> list[int]:
    """Indices of the tokens (after the first) whose logprobs are compared, evenly spread, in order."""
    if length < 2:
        raise ValueError("a probe needs at least two tokens")
    count = min(count, length - 1)
    return sorted({1 + round(k * (length - 2) / max(1, count - 1)) for k in range(count)})


async def served_logprobs(engine: VLLMEngine, model: str, token_ids: list[int], positions: list[int], *,
                          timeout: float = 120.0) -> list[float]:
    """The replica's logprob of `token_ids[i]` after `token_ids[:i]`, for each of `positions`, scored by `model`
    (a LoRA adapter's name, or the base model's for full weights): one forced one-token generation each."""
    async with async_http_client(engine.base_url, timeout=timeout) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": model, "prompt": token_ids[:i], "max_tokens": 1, "temperature": 0.0, "logprobs": 0,
            "allowed_token_ids": [token_ids[i]]}) for i in positions))
    scores = []
    for i, response in zip(positions, responses, strict=True):
        if response.status_code != 200:
            raise RuntimeError(f"the probe request failed with {response.status_code}: {response.text[:300]}")
        logprob = ((response.json()["choices"][0].get("logprobs") or {}).get("token_logprobs") or [None])[0]
        if logprob is None:
            raise RuntimeError(f"the probe request at position {i} returned no logprob")
        scores.append(float(logprob))
    return scores


class ProbeCheck:
    """Scores a checkpoint's probe on one replica (what `ReplicaPublisher` calls after each load)."""

    def __init__(self, dtype: str, tolerance: float | None = None) -> None:
        if dtype not in TOLERANCE:
            raise ValueError(f"no probe tolerance for dtype {dtype!r} (known: {', '.join(TOLERANCE)})")
        self.dtype = dtype
        self.tolerance = tolerance if tolerance is not None else TOLERANCE[dtype]

    async def __call__(self, engine: VLLMEngine, model: str, directory: Path) -> ProbeResult | None:
        """None when the checkpoint carries no probe (nothing to compare against)."""
        probe = read_probe(directory)
        if probe is None:
            return None
        positions = probe_positions(len(probe.token_ids))
        served = await served_logprobs(engine, model, probe.token_ids, positions)
        return compare([probe.logprobs[i - 1] for i in positions], served, self.tolerance)
