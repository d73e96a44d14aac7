"""Parse a request body as JSON only after bounding its size, nesting depth and number of values.

tritonserver's HTTP front parses JSON recursively (a body nested 150,000 levels deep overflows its
stack and kills the server) and in time quadratic in the number of fields, and neither can be
configured.  trtkv's own HTTP front end (`http_front.py`) therefore checks every body here first:
the checks are linear-time (a regex blanks out string contents, numpy counts brackets), so a
hostile body costs at most one pass over `max_bytes` before it is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


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


def structure(body: bytes) -> tuple[int, int]:
    """(nesting depth, separators) of a JSON text, ignoring what is inside strings."""
    skeleton = _STRING.sub(b'""', body)
    arr = np.frombuffer(skeleton, dtype=np.uint8)
    opens = (arr == ord("[")) | (arr == ord("{"))
    closes = (arr == ord("]")) | (arr == ord("}"))
    depth = int(np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)).max(initial=0))
    values = int(np.count_nonzero((arr == ord(",")) | (arr == ord(":"))))
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
