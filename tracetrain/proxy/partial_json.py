"""JSON cut short, read as far as it goes: the object a tool call's arguments spell when the token limit cut
them, or when they are not quite JSON (the Messages API's `tool_use.input` must be an object)."""

from __future__ import annotations

import json
import re
from typing import Any


def partial_object(arguments: str) -> dict[str, Any]:
    """The JSON object that `arguments`, JSON cut short or not quite JSON, spells as far as it can be read:
    its whole members, and a string cut short as far as it goes; {} when nothing can be read."""
    try:
        value = json.loads(arguments)
        return value if isinstance(value, dict) else {"value": value}
    except json.JSONDecodeError:
        pass
    # Cut at each structural point, latest first, and close what is open there.
    for point in [len(arguments), *reversed(_structural_points(arguments))]:
        closed = _closed(arguments[:point].rstrip().rstrip(","))
        if closed is None:
            continue
        try:
            value = json.loads(closed)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _structural_points(text: str) -> list[int]:
    """Offsets just before a `,` or just after a `{` or `[` outside strings: where a member can end."""
    points, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch == ",":
            points.append(i)
        elif ch in "{[":
            points.append(i + 1)
    return points


def _closed(prefix: str) -> str | None:
    """`prefix` with its open string, arrays and objects closed (None if its brackets do not nest)."""
    stack: list[str] = []
    in_string, escaped = False, False
    for ch in prefix:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and (not stack or stack.pop() != ch):
            return None
    if in_string:  # close the string, dropping an escape cut short
        cut_unicode = re.search(r"(\\+)u[0-9a-fA-F]{0,3}$", prefix)
        if escaped:
            prefix = prefix[:-1]
        elif cut_unicode and len(cut_unicode.group(1)) % 2:
            prefix = prefix[:cut_unicode.start() + len(cut_unicode.group(1)) - 1]
        prefix += '"'
    return prefix + "".join(reversed(stack))
