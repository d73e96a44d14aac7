"""Byte sizes as users write them (``2GiB``, ``80GB``, ``4096``): one parser for the CLI, the cache
settings and the bench, so a size means the same everywhere."""
from __future__ import annotations

import re

from trtkv.errors import TrtkvError

SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """``"2GiB"`` -> 2147483648; decimal (GB) and binary (GiB) units, bare numbers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in SIZE_UNITS:
        raise TrtkvError(f"cannot read the size {text!r}; write it like 2GiB, 512MiB, 8GB or a number of bytes")
    n = int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise TrtkvError(f"the size {text!r} must be positive")
    return n
