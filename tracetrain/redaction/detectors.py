"""Detectors of personal data and secrets in text: pure functions, no state, no I/O.

Each detector is a regular expression that proposes candidates and, where the format has one, a check
that confirms them (Luhn for cards, ISO 7064 mod 97 for IBANs, the address parser for IPs, character
classes and entropy for unprefixed keys). A check is what keeps order numbers, version strings, dates,
UUIDs and hashes out: tests/unit/test_redaction_detectors.py states the false positives accepted.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    start: int
    end: int
    kind: str
    """The placeholder's name: `EMAIL` is stored as `[EMAIL]`."""


Check = Callable[[str], bool]

_EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9._%+-]{1,64}@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}\b")
# Grouped the ways numbers are written: +CC and 7–14 more digits, or North American 3-3-4. A bare run
# of digits is not a phone number here: it is as often an id, a count or a timestamp.
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}"
                    r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}|\d{3}[.-]\d{3}[.-]\d{4})(?![\w-])")
_CARD = re.compile(r"(?<![\w-])\d(?:[ -]?\d){12,18}(?![\w-])")
_IBAN = re.compile(r"(?<![\w])[A-Z]{2}\d{2}(?: ?[A-Z0-9]{1,4}){3,8}(?![\w])")
# Keys by their issuers' prefixes: OpenAI/Anthropic, Stripe, GitHub, Slack, AWS, Google, GitLab, JWTs.
_KEY = re.compile(r"(?<![\w-])(?:sk-(?:ant-|proj-)?[A-Za-z0-9_-]{20,}|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"
                  r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|xox[abposr]-[A-Za-z0-9-]{10,}"
                  r"|(?:AKIA|ASIA)[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{35}|glpat-[A-Za-z0-9_-]{20}"
                  r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})(?![\w-])")
_BEARER = re.compile(r"(?<=[Bb]earer )[A-Za-z0-9._~+/=-]{16,}")
# Unprefixed keys: a run of 24–200 key characters mixing upper case, lower case and digits, with high
# entropy. Hex digests and UUIDs have no upper case; words and identifiers have too little entropy; a
# longer run is a blob (base64 data), not a key.
_RANDOM = re.compile(r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/=_-]{24,200}(?![A-Za-z0-9+/=_-])")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")


def luhn(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


_ISSUERS: tuple[tuple[tuple[int, int], tuple[int, ...]], ...] = (
    ((4, 4), (13, 16, 19)),                                        # Visa
    ((51, 55), (16,)), ((2221, 2720), (16,)),                      # Mastercard
    ((34, 34), (15,)), ((37, 37), (15,)),                          # American Express
    ((6011, 6011), (16, 17, 18, 19)), ((644, 649), (16, 17, 18, 19)), ((65, 65), (16, 17, 18, 19)),  # Discover
    ((300, 305), (14, 16, 17, 18, 19)), ((36, 36), (14, 16, 17, 18, 19)), ((38, 39), (16, 17, 18, 19)),  # Diners
    ((3528, 3589), (16, 17, 18, 19)),                              # JCB
    ((62, 62), (16, 17, 18, 19)),                                  # UnionPay
)
"""Issuer number ranges (by leading digits) and the lengths each issues. Random digit strings pass Luhn one
time in ten; an issuer's prefix and length as well cuts that to about one in fifty."""


def _issued(digits: str) -> bool:
    return any(low <= int(digits[:len(str(low))]) <= high and len(digits) in lengths
               for (low, high), lengths in _ISSUERS)


def _card(text: str) -> bool:
    digits = re.sub(r"\D", "", text)
    # A number of one repeated digit is a placeholder, not a card.
    return _issued(digits) and luhn(digits) and len(set(digits)) > 1


def _iban(text: str) -> bool:
    compact = text.replace(" ", "")
    if not 15 <= len(compact) <= 34:
        return False
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def entropy(text: str) -> float:
    """Shannon entropy in bits per character."""
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _random_key(text: str) -> bool:
    core = text.strip("=")
    classes = (any(c.isupper() for c in core), any(c.islower() for c in core),
               sum(c.isdigit() for c in core) >= 2)
    return all(classes) and entropy(core) >= 4.2


def _phone(text: str) -> bool:
    return 7 <= sum(c.isdigit() for c in text) <= 15


def _ip(text: str) -> bool:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    # Loopback and the unspecified address name no one: they fill code and configuration.
    return not (address.is_loopback or address.is_unspecified)


_KEY_PREFIXES = ("sk-", "_live_", "_test_", "gh", "github_pat_", "xox", "AKIA", "ASIA", "AIza", "glpat-", "eyJ")
_DIGITS = re.compile(r"\d[\d ().+-]{5,}\d|\d\.\d")


def _has_digits(text: str) -> bool:
    return _DIGITS.search(text) is not None


def _always(text: str) -> bool:
    return True


def _long_word(text: str) -> bool:
    return any(len(word) >= 24 for word in text.split())


DETECTORS: tuple[tuple[str, re.Pattern[str], Check | None, Check], ...] = (
    ("SECRET", _KEY, None, lambda t: any(p in t for p in _KEY_PREFIXES)),
    ("SECRET", _BEARER, None, lambda t: "earer " in t),
    ("EMAIL", _EMAIL, None, lambda t: "@" in t),
    ("IBAN", _IBAN, _iban, _has_digits),
    ("CARD", _CARD, _card, _has_digits),
    ("IP", _IPV4, _ip, _has_digits),
    ("IP", _IPV6, lambda t: t.count(":") >= 2 and sum(c not in ":" for c in t) >= 2 and _ip(t),
     lambda t: t.count(":") >= 2),
    ("PHONE", _PHONE, _phone, _has_digits),
    ("SECRET", _RANDOM, _random_key, _long_word),
)
"""In order of precedence: where two findings overlap, the earlier detector's wins. The last element is a
cheap test that the text may hold one at all (a scan of each pattern over every message is most of the cost)."""
TYPES = ("EMAIL", "PHONE", "CARD", "IBAN", "SECRET", "IP")


def find(text: str, extra: Iterable[tuple[str, re.Pattern[str]]] = ()) -> list[Finding]:
    """Non-overlapping findings in `text`, in order; `extra` are (kind, pattern) pairs from the config,
    which take precedence over the built-in detectors."""
    taken: list[Finding] = []
    detectors = [(kind, pattern, None, _always) for kind, pattern in extra] + list(DETECTORS)
    digits: bool | None = None
    for kind, pattern, check, may in detectors:
        if may is _has_digits:
            digits = _has_digits(text) if digits is None else digits
            if not digits:
                continue
        elif not may(text):
            continue
        for match in pattern.finditer(text):
            start, end = match.span()
            if start == end or (check is not None and not check(match.group())):
                continue
            if any(f.start < end and start < f.end for f in taken):
                continue
            taken.append(Finding(start, end, kind))
    return sorted(taken, key=lambda f: f.start)


def replace(text: str, findings: list[Finding]) -> str:
    """`text` with each finding replaced by its placeholder (`[EMAIL]`)."""
    parts, at = [], 0
    for f in findings:
        parts += [text[at:f.start], f"[{f.kind}]"]
        at = f.end
    parts.append(text[at:])
    return "".join(parts)
