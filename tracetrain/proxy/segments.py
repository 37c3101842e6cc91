"""Prompt encoding by pieces, the pieces that repeat remembered.

A tokenizer splits its input at its added tokens (`<|im_start|>`, `<|im_end|>`, …) before anything
else and encodes the text between them on its own. A rendered chat prompt is mostly such pieces, and
many repeat from call to call: the system prompt, the tool list, `assistant\\n`. Encoding was the largest
single cost of the gateway's CPU per call (a fifth at 16 connections, profiled; the byte-level
pre-tokenizer's regex is most of it), and agents send the same system prompt and tools with every new
session, so remembered pieces save most of it there.

Whether pieces encode exactly as the whole text does depends on the tokenizer (a Metaspace pre-tokenizer
that marks only the first piece would not), so it is checked on sample prompts when the encoder is made;
`make_segment_encoder` returns None for a tokenizer that fails, and the renderer encodes whole texts.
"""

from __future__ import annotations

import re
from typing import Any

from cachetools import LRUCache

CACHE_TOKENS = 2_000_000
"""How many remembered token ids: a few hundred long system prompts with their tools, ~20 MB."""


class SegmentEncoder:
    def __init__(self, backend: Any, added: dict[str, int]) -> None:
        self.backend = backend
        self.added = added
        # Longest first: at one position the longest added token wins, as in the tokenizer's own split.
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._pieces: LRUCache[str, list[int]] = LRUCache(maxsize=CACHE_TOKENS, getsizeof=len)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # the split's captured separators: the added tokens
                ids.append(self.added[piece])
            elif piece:
                found = self._pieces.get(piece)
                if found is None:
                    found = self._pieces[piece] = list(self.backend.encode(piece, add_special_tokens=False).ids)
                ids += found
        return ids


def make_segment_encoder(backend: Any, samples: list[str]) -> SegmentEncoder | None:
    """An encoder for `backend` (a `tokenizers.Tokenizer`), or None when encoding by pieces would differ
    from encoding whole texts: on any of `samples`, or for added tokens that strip or match whole words."""
    tokens = backend.get_added_tokens_decoder()
    if not tokens or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens.values()):
        return None
    encoder = SegmentEncoder(backend, {t.content: i for i, t in tokens.items()})
    for text in samples:
        if encoder.encode(text) != list(backend.encode(text, add_special_tokens=False).ids):
            return None
    encoder._pieces.clear()
    return encoder
