"""Replaying past successes: self-imitation learning (Oh et al. 2018, "Self-Imitation Learning").

On a hard task a success is rare, and one policy-gradient step on it moves the policy only a little
before it is gone. Self-imitation keeps such samples and trains on them again in later steps with
the advantage max(R - V, 0): only where the sample did better than the value expected of it now, so
a success of a prompt the agents keep asking stops being replayed once the policy has learned to
succeed that often. (A prompt never asked again keeps its group's last baseline; `max_age` then
ends its replay.)

Deviations from the paper: V is the running baseline of the sample's group key (the same one groups
of one are trained against: `baseline.py`), not a learned value head; the replayed sample goes
through the same clipped policy loss as the fresh ones, with truncated importance sampling against
the logprobs it was sampled with (`importance.py`), not through a separate imitation loss; and a
sample is kept for at most `max_age` versions, since its behaviour logprobs age with it. The buffer
lives in the trainer's memory; each version's resume state names the sessions it holds (`state_dict`),
so a restarted trainer reloads them from the store (`restore`) rather than starting with an empty one.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from tracetrain.trainer.algorithms.baseline import RunningBaseline
from tracetrain.trainer.data import Sample


@dataclass
class _Kept:
    sample: Sample
    version: int
    """The version trained when the sample was first learned from."""


class SuccessReplay:
    def __init__(self, per_step: int, max_age: int, seed: int = 0, capacity: int = 1024) -> None:
        self.per_step = per_step
        """Samples replayed per step at most."""
        self.max_age = max_age
        """Versions after which a kept sample is dropped."""
        self.kept: deque[_Kept] = deque(maxlen=capacity)
        self.rng = random.Random(seed)

    def keep(self, samples: list[Sample], advantages: list[float], version: int) -> None:
        """Keep the samples of a step that did better than expected (a positive advantage)."""
        self.kept.extend(_Kept(s, version) for s, a in zip(samples, advantages, strict=True) if a > 0)

    def draw(self, version: int, baseline: RunningBaseline) -> tuple[list[Sample], list[float]]:
        """Up to `per_step` kept samples no older than `max_age` versions whose reward is still above their
        group's baseline, each with the advantage R - V. Drawn without replacement with probability in
        proportion to R - V, as the paper's prioritized replay does (Efraimidis and Spirakis' keys:
        u ** (1 / weight), the largest win)."""
        while self.kept and version - self.kept[0].version > self.max_age:
            self.kept.popleft()
        candidates = [(k.sample, k.sample.reward - baseline.value(k.sample.group_id)) for k in self.kept]
        keyed = sorted(((self.rng.random() ** (1 / a), s, a) for s, a in candidates if a > 0),
                       key=lambda x: x[0], reverse=True)
        chosen = keyed[: self.per_step]
        return [s for _, s, _ in chosen], [a for _, _, a in chosen]

    def state_dict(self) -> list[list[Any]]:
        """What a resume state keeps: each kept sample's session id and version, oldest first. The samples
        themselves are in the store, which is where `restore` reads them from."""
        return [[k.sample.session_id, k.version] for k in self.kept]

    def restore(self, state: list[list[Any]], samples: dict[str, Sample]) -> None:
        """Take back a `state_dict`, with `samples` (by session id) loaded from the store; a session the
        store no longer holds (retention deleted it) is left out."""
        self.kept.clear()
        self.kept.extend(_Kept(samples[sid], int(version)) for sid, version in state if sid in samples)
