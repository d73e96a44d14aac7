"""KV storage formats, by name. ``get_format('nvfp4')``; ``FORMATS`` lists them all."""
from __future__ import annotations

from .base import FieldSpec, KVFormat, LayerScales
from .floating import BF16, FP16, FP32

FORMATS: dict[str, KVFormat] = {}


def register_format(fmt: KVFormat) -> KVFormat:
    if fmt.name in FORMATS or any(f.code == fmt.code for f in FORMATS.values()):
        raise ValueError(f"KV format {fmt.name!r} (code {fmt.code}) registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


for _f in (FP32, FP16, BF16):
    register_format(_f)

# quantized formats register themselves on import (kept in their own modules)
from . import quantized as _quantized  # noqa: E402,F401


def get_format(name: str) -> KVFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r}; choose one of: {', '.join(FORMATS)}") from None


def format_by_code(code: int) -> KVFormat:
    for f in FORMATS.values():
        if f.code == code:
            return f
    raise ValueError(f"unknown KV format code {code}")


__all__ = ["FieldSpec", "KVFormat", "LayerScales", "FORMATS", "get_format", "format_by_code", "register_format"]
