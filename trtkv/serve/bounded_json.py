"""Parse a request body as JSON only after bounding its size, nesting depth and number of values.

tritonserver's HTTP front parses JSON recursively (a body nested 150,000 levels deep overflows its
stack and kills the server) and in time quadratic in the number of fields, and neither can be
configured.  trtkv's own HTTP front end (`http_front.py`) therefore checks every body here first:
the checks are linear-time (a few numpy passes find the string contents and count brackets outside them), so
a hostile body costs at most a few passes over `max_bytes` before it is refused.  (A regex that blanks out
strings was quadratic on an unterminated string of many `\\"` pairs: 80 KB took 12 s, issue 38.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class JsonLimits:
    """What one request body may hold; the defaults fit any real prompt of a 128k-token model."""

    max_bytes: int = 4 << 20
    max_depth: int = 16
    max_values: int = 4096  # commas + colons: array elements and object fields together


class BodyError(ValueError):
    """The body is not acceptable JSON; the message says why (sent to the client as a 4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def outside_strings(arr: np.ndarray) -> np.ndarray:
    """Mask of the bytes of a JSON text that are not inside a string literal, in O(n).

    A quote opens or closes a string unless an odd run of backslashes precedes it; in valid JSON a
    backslash occurs only inside strings, so this is exact for every text `json.loads` accepts (an
    unterminated string makes the rest of the text "inside", and the parse fails anyway).
    """
    n = arr.size
    index_type = np.int32 if n < 2**31 else np.int64
    quotes = np.flatnonzero(arr == ord('"')).astype(index_type)
    if quotes.size == 0:
        return np.ones(n, dtype=bool)
    # index of the last byte at or before i that is not a backslash (-1 when there is none)
    not_backslash = np.where(arr != ord("\\"), np.arange(n, dtype=index_type), index_type(-1))
    last_plain = np.maximum.accumulate(not_backslash)
    before = np.maximum(quotes - 1, 0)
    run = np.where(quotes > 0, before - last_plain[before], 0)  # backslashes right before each quote
    toggles = np.zeros(n, dtype=np.uint8)
    toggles[quotes[run % 2 == 0]] = 1
    return np.bitwise_xor.accumulate(toggles) == 0  # an odd number of real quotes so far: inside


def structure(body: bytes) -> tuple[int, int]:
    """(nesting depth, separators) of a JSON text, ignoring what is inside strings; linear time."""
    arr = np.frombuffer(body, dtype=np.uint8)
    if arr.size == 0:
        return 0, 0
    outside = outside_strings(arr)
    opens = ((arr == ord("[")) | (arr == ord("{"))) & outside
    closes = ((arr == ord("]")) | (arr == ord("}"))) & outside
    depth = int(np.cumsum(opens.view(np.int8) - closes.view(np.int8), dtype=np.int32).max(initial=0))
    values = int(np.count_nonzero(((arr == ord(",")) | (arr == ord(":"))) & outside))
    return depth, values


def parse_body(body: bytes, limits: JsonLimits = JsonLimits()) -> dict[str, Any]:
    """The body as a JSON object, or `BodyError` (413 when too large, else 400)."""
    if len(body) > limits.max_bytes:
        raise BodyError(f"request body is {len(body)} bytes; the limit is {limits.max_bytes}", 413)
    if not body.strip():
        raise BodyError("request body is empty; send a JSON object")
    depth, values = structure(body)
    if depth > limits.max_depth:
        raise BodyError(f"JSON nested {depth} levels deep; the limit is {limits.max_depth}")
    if values > limits.max_values:
        raise BodyError(f"JSON holds {values} values; the limit is {limits.max_values}")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BodyError(f"request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise BodyError(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj
