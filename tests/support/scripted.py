"""An engine that samples a scripted reply: the tokens of a given text, one at a time, then the turn end;
cut at `max_tokens` as a real engine cuts it.

For tests about what the model writes (a secret in a reply or a tool call's arguments), which no tiny
model can be made to write on cue. Everything else (rendering, parsing, chaining, storage) is real.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tracetrain.engines.base import Affinity, SamplingParams, TokenDelta


class ScriptedEngine:
    def __init__(self, tokenizer: Any, model_name: str = "scripted") -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.replies: list[str] = []
        """What the next calls sample, in order (each call takes the first)."""
        self.prompts: list[list[int]] = []
        self.samples: list[list[int]] = []

    @property
    def version(self) -> int:
        return 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        cut = len(ids) > params.max_tokens  # as an engine does: the reply ends there, without the turn end
        ids = ids[:params.max_tokens]
        self.samples.append(ids)
        shown = ""
        for i, token in enumerate(ids):
            text = self.tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
            piece = text[len(shown):] if not text.endswith("\ufffd") else ""
            shown += piece
            last = i == len(ids) - 1
            yield TokenDelta([token], [-0.25], piece, finish_reason=("length" if cut else "stop") if last else None,
                             version=0)

    async def close(self) -> None:
        return None
