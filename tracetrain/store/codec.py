"""Compact encodings for token arrays: little-endian int32 ids and float32 logprobs as raw bytes.

Four bytes a token instead of a JSON list's six to eight, and no parsing on read.
"""

from __future__ import annotations

import sys
from array import array


def _to_bytes(values: array) -> bytes:
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def _from_bytes(typecode: str, data: bytes | None) -> array:
    values = array(typecode)
    if data:
        values.frombytes(data)
        if sys.byteorder != "little":
            values.byteswap()
    return values


def encode_ids(ids: list[int]) -> bytes:
    return _to_bytes(array("i", ids))


def decode_ids(data: bytes | None) -> list[int]:
    return _from_bytes("i", data).tolist()


def encode_floats(values: list[float]) -> bytes:
    return _to_bytes(array("f", values))


def decode_floats(data: bytes | None) -> list[float]:
    return _from_bytes("f", data).tolist()
