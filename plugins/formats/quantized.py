"""Quantized formats (FP8, NVFP4, ternary, INT4/INT2, and the key-offset nvfp4o/ternaryo).

Registered on import of plugins.formats; one module per family keeps each bit layout readable on
its own. The layouts (field names, order, shapes, bit positions) are a contract with the Triton
kv_write/attention kernels, which take the field lists positionally.
"""
from __future__ import annotations

import math

import torch

from . import register_format
from .base import KVFormat, LayerScales
from .fp8 import FP8
from .intq import INT2, INT4
from .nvfp4 import NVFP4, NVFP4O
from .ternary import TERNARY, TERNARYO

QUANTIZED_FORMATS = (FP8, NVFP4, TERNARY, INT4, INT2, NVFP4O, TERNARYO)
for _f in QUANTIZED_FORMATS:
    register_format(_f)


def calibrate_layer_scales(k_amax: float, v_amax: float, fmt: KVFormat) -> LayerScales:
    """Static per-layer scales from observed amax, so the largest value maps to the top of the
    E4M3 scale range (NVFP4: amax/(6*448); ternary, FP8: amax/448); 1.0 where the format has no
    static scale or the amax is unusable (0, inf, NaN).

    A 2**-20 relative headroom keeps fp32 rounding of ``amax / (qmax * s)`` from tipping the
    calibration maximum itself over 448, which would count as a (spurious) scale saturation."""
    rng = getattr(fmt, "calib_range", 0.0)

    def one(amax: float) -> float:
        if not rng or not math.isfinite(amax) or amax <= 0:
            return 1.0
        return float(amax) / rng * (1 + 2.0**-20)

    return LayerScales(k=one(k_amax), v=one(v_amax))


def count_saturated(fmt: KVFormat, k: torch.Tensor, v: torch.Tensor, scales: LayerScales) -> tuple[int, int]:
    """(K, V) counts of clipped scale groups (NVFP4/ternary) or elements (FP8) for one flush group;
    (0, 0) for formats that cannot clip. Syncs with the device: for diagnostics, not the hot path."""
    if not hasattr(fmt, "saturated"):
        return 0, 0
    nk, nv = fmt.saturated(k, v, scales)
    return int(nk), int(nv)


__all__ = ["QUANTIZED_FORMATS", "calibrate_layer_scales", "count_saturated"]
