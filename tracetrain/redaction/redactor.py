"""What the detectors find, applied: to strings, to JSON documents (messages in any API's shape) and
to token sequences, counting what was found by type.

The same text always redacts the same way, so a request that repeats an earlier call's messages
hashes the same after redaction as that call's stored state (see proxy/chain.py).
"""

from __future__ import annotations

import functools
import json
import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tracetrain.redaction.detectors import Finding, find, replace

MODES = ("off", "detect", "redact")
IDENTIFIERS = frozenset({"id", "tool_call_id", "tool_use_id", "call_id", "type", "role", "name"})
"""Keys whose values are protocol identifiers, not content: left as sent (a tool-use id such as
`toolu_01A09q90qw90lq917835lq9` would otherwise look like a random key)."""


@dataclass
class Found:
    """What one call's texts held: counts by type and the original values (kept in memory only, to find
    them again in the call's tokens)."""

    counts: Counter[str] = field(default_factory=Counter)
    values: set[str] = field(default_factory=set)


class Redactor:
    def __init__(self, mode: str, patterns: Mapping[str, str] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"redaction must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.patterns = [(name.upper(), re.compile(regex)) for name, regex in (patterns or {}).items()]
        # Agents resend their whole history with every request: each message's text is scanned once, then
        # remembered (in this process's memory only, like the token chains).
        self._find = functools.lru_cache(maxsize=8192)(self._scan)

    def _scan(self, text: str) -> tuple[Finding, ...]:
        return tuple(find(text, self.patterns))

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @property
    def redacts(self) -> bool:
        return self.mode == "redact"

    def text(self, text: str, found: Found) -> str:
        """`text` with placeholders (in `detect` mode, unchanged), the findings added to `found`."""
        findings = self._find(text)
        if not findings:
            return text
        for f in findings:
            found.counts[f.kind] += 1
            found.values.add(text[f.start:f.end])
        return replace(text, list(findings)) if self.redacts else text

    def document(self, value: Any, found: Found) -> Any:
        """A JSON value with every string redacted but protocol identifiers; a new value, never the same
        object changed (the agent's reply is served from the original)."""
        if isinstance(value, str):
            return self.text(value, found)
        if isinstance(value, list):
            return [self.document(v, found) for v in value]
        if isinstance(value, dict):
            return {k: v if k in IDENTIFIERS and isinstance(v, str) else self.document(v, found)
                    for k, v in value.items()}
        return value

    def token_spans(self, pieces: list[str], values: Iterable[str], *, scan: bool) -> list[tuple[int, int]]:
        """Token ranges [start, end) to mask in a sequence whose tokens spell `pieces`: every token that
        overlaps an occurrence of one of `values`, or (with `scan`) of a finding in the spelled text."""
        text = "".join(pieces)
        spans: list[tuple[int, int]] = []
        for value in _spellings(values):
            at = text.find(value)
            while at >= 0:
                spans.append((at, at + len(value)))
                at = text.find(value, at + 1)
        if scan:
            spans += [(f.start, f.end) for f in find(text, self.patterns)]
        return _tokens_over(pieces, spans)


def _spellings(values: Iterable[str]) -> set[str]:
    """Each value as written and as a JSON string's body (a template may render it escaped)."""
    out = set()
    for value in values:
        out.add(value)
        out.add(json.dumps(value, ensure_ascii=False)[1:-1])
    out.discard("")
    return out


def _tokens_over(pieces: list[str], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merged token ranges covering every character span."""
    if not spans:
        return []
    ends, at = [], 0
    for piece in pieces:
        at += len(piece)
        ends.append(at)
    masked = [False] * len(pieces)
    for lo, hi in spans:
        i = bisect_left(ends, lo)
        while i < len(pieces) and ends[i] - len(pieces[i]) < hi:
            start, end = ends[i] - len(pieces[i]), ends[i]
            # An empty piece (a token holding part of a character) belongs to the character after it.
            if lo < end or (start == end and lo <= start):
                masked[i] = True
            i += 1
    return runs(masked)


def runs(masked: list[bool]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i, m in enumerate(masked):
        if not m:
            continue
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
