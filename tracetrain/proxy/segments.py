"""Prompt encoding by pieces, the pieces that repeat remembered.

A tokenizer splits its input at its added tokens (`<|im_start|>`, `<|im_end|>`, …) before anything
else and encodes the text between them on its own. A rendered chat prompt is mostly such pieces, and
many repeat from call to call: the system prompt, the tool list, `assistant\\n`. Encoding was the largest
single cost of the gateway's CPU per call when profiled (the byte-level pre-tokenizer's regex is most of
it), and agents send the same system prompt and tools with every new
session, so remembered pieces save most of it there.

A piece seen for the first time (the new user message) is split further, into words, and words repeat
across messages even when messages do not. The split is at a space between an ASCII letter or digit and
an ASCII letter: byte-level BPE pre-tokenizers (GPT-2's pattern, and Llama 3's and Qwen's) always start a
pre-token there (` ?\\p{L}+`, `[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`: only whitespace runs cross a space, and the
character before is none), none of their patterns looks behind, and BPE never merges across pre-tokens,
so each word encodes alone as it does in the whole text. A remembered word is a dict lookup in C, cheaper
than the pre-tokenizer's pass over it; a word not seen before costs a tokenizer call of its own. The
figures from when this was measured are in the commit that added it.

Numbers are split further where the vocabulary allows it. Ids, counts and paths put a new number in
many messages ("trace48213"), which made the whole word new. In a vocabulary where no token holds an ASCII
digit together with anything else (SmolLM2's: every digit is a token of its own), BPE never merges a digit
with a neighbour: inside a pre-token a digit is a wall that BPE's merges do not cross, and a run of
digits is one id per digit. A piece is then cut after every run of digits and before it: before the
space in front of it where that space starts a word (after a letter or digit), else before the digits
where they follow anything but whitespace. Digits after a whitespace run are left in their word: cut
there, the run would end a text, where a pre-tokenizer's look-ahead (`\\s+(?!\\S)`) splits it differently.
A run of digits, with the one space before it, then costs a dict lookup per digit and is not remembered
(numbers rarely repeat, and would push words out).

Whether pieces encode exactly as the whole text does depends on the tokenizer (a Metaspace pre-tokenizer
that marks only the first piece would not), so it is checked on sample prompts when the encoder is made;
`make_segment_encoder` returns None for a tokenizer that fails, and the renderer encodes whole texts.
Words are split only for the byte-level tokenizers the argument above covers, numbers only where the
vocabulary has the property above, both also checked on samples.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Iterable
from typing import Any

from cachetools import LRUCache

CACHE_TOKENS = 2_000_000
"""How many remembered token ids: a few hundred long system prompts with their tools, ~20 MB."""
CACHE_WORDS = 50_000
"""How many remembered words: a word with its leading space and ids takes ~250 bytes (measured), so
~12 MB at most in each gateway process; a language's common words fit many times over."""
_WORD_START = re.compile(r"(?<=[A-Za-z0-9])(?= [A-Za-z])")
"""Zero-width: `re.split` cuts there and keeps the space with the word after it."""
_DIGIT = re.compile(r"[0-9]")
_NUMBER = re.compile(r"[0-9]+")
_DIGITS = frozenset("0123456789")
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_WORD_SAMPLES = [
    "Hello there, it's 12345 apples and 6789 pears; don't you think so?  Two  spaces\tand tabs.",
    "naïve café über Straße 日本語 words, mixed Case WORDS and x2 y3 z4 a1b2 CamelCase snake_case.",
    "The quick brown fox jumps over the lazy dog. I'M SHOUTING and she'll say we've 're 'd 'll 'm 've.",
    "  leading spaces and trailing ones   ",
    "trace48213 see 48213 items, 1,000,000 v1.2.3 0x1F -42 3.14 12 34 a\t\t4 b  56 c\n\n789\n x²3 ٣4 5's 6th",
    "foo_123_bar(7) [8, 9] {\"n\": 10} 2026-11-26T01:07:49Z 1e-5 #42 $3 99% 0 00 007 ID7G A1 z9 9z",
]


class SegmentEncoder:
    def __init__(self, backend: Any, added: dict[str, int], *, by_words: bool, by_digits: bool = False) -> None:
        self.backend = backend
        self.added = added
        self.by_words = by_words
        self.by_digits = by_digits
        if by_digits:
            self._space = self._encode_alone(" ")
            self._digit_ids = {d: self._encode_alone(d)[0] for d in sorted(_DIGITS)}
        # Longest first: at one position the longest added token wins, as in the tokenizer's own split.
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._pieces: LRUCache[str, list[int]] = LRUCache(maxsize=CACHE_TOKENS, getsizeof=len)
        self._word = functools.lru_cache(maxsize=CACHE_WORDS)(self._encode_alone)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # the split's captured separators: the added tokens
                ids.append(self.added[piece])
            elif piece:
                found = self._pieces.get(piece)
                if found is None:
                    found = self._pieces[piece] = self._encode_piece(piece)
                ids += found
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        if not self.by_words:
            return list(self._encode_alone(piece))
        if not self.by_digits:
            return list(self._words(piece))
        ids: list[int] = []
        done = 0  # piece[:done] is encoded
        for number in _NUMBER.finditer(piece):
            start, end = number.span()
            before = piece[start - 1] if start else ""
            if before == " " and (start == 1 or piece[start - 2] in _ALNUM):
                cut = start - 1  # a word's start: the space goes with the digits, as ` ?\p{N}+` takes it
            elif not before.isspace():
                cut = start
            else:
                continue  # after a whitespace run: digits and all go to the words (the run must stay whole)
            ids += self._words(piece[done:cut])
            if cut < start:
                ids += self._space
            ids += [self._digit_ids[d] for d in number.group()]
            done = end
        ids += self._words(piece[done:])
        return ids

    def _words(self, text: str) -> Iterable[int]:
        return itertools.chain.from_iterable(map(self._word, _WORD_START.split(text)))

    def _encode_alone(self, text: str) -> tuple[int, ...]:
        return tuple(self.backend.encode(text, add_special_tokens=False).ids)

    def clear(self) -> None:
        self._pieces.clear()
        self._word.cache_clear()


def make_segment_encoder(backend: Any, samples: list[str]) -> SegmentEncoder | None:
    """An encoder for `backend` (a `tokenizers.Tokenizer`), or None when encoding by pieces would differ
    from encoding whole texts: on any of `samples`, or for added tokens that strip or match whole words."""
    tokens = backend.get_added_tokens_decoder()
    if not tokens or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens.values()):
        return None
    added = {t.content: i for i, t in tokens.items()}
    byte_level = _byte_level(backend)
    ways = [(True, True)] if byte_level and _digits_alone(backend) else []
    ways += [(True, False), (False, False)] if byte_level else [(False, False)]
    for by_words, by_digits in ways:
        encoder = SegmentEncoder(backend, added, by_words=by_words, by_digits=by_digits)
        checks = samples + _WORD_SAMPLES if by_words else samples
        if all(encoder.encode(text) == list(backend.encode(text, add_special_tokens=False).ids) for text in checks):
            encoder.clear()
            return encoder
    return None


def _digits_alone(backend: Any) -> bool:
    """Whether no token of the vocabulary holds an ASCII digit together with anything else, and a digit and
    a space each encode to one id (see the module's docstring)."""
    if any(len(token) > 1 and _DIGIT.search(token) for token in backend.get_vocab()):
        return False
    return all(len(backend.encode(c, add_special_tokens=False).ids) == 1 for c in [" ", *_DIGITS])


def _byte_level(backend: Any) -> bool:
    """Whether words may be encoded alone (see the module's docstring): a byte-level BPE whose pre-tokenizer
    is ByteLevel's own regex or a regex Split before a regex-free ByteLevel, adding no prefix space, after no
    normalizer or one that keeps ASCII as it is (NFC)."""
    spec = json.loads(backend.to_str())
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if model.get("type") != "BPE" or not kinds or kinds[-1] != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return False
    if kinds == ["ByteLevel"]:
        regex_ok = steps[0].get("use_regex", True)
    else:
        split, byte_level = steps
        regex_ok = (kinds == ["Split", "ByteLevel"] and "Regex" in (split.get("pattern") or {})
                    and split.get("behavior") == "Isolated" and not split.get("invert")
                    and not byte_level.get("use_regex", True))
    norms = [] if norm is None else norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
    return bool(regex_ok) and all(n.get("type") == "NFC" for n in norms)
