"""NVFP4: E2M1 elements with an E4M3 scale per 16 (spec §3.2), plus the key-offset variant ``nvfp4o``.

Element nibble: bit 3 sign, bits 2..0 index E2M1_VALUES. The sign bit is the fp32 sign bit of
``x / s_eff`` (as the hardware cvt sets it), so a small negative that rounds to 0 stores 0x8;
both zeros decode to 0. Groups whose scale is 0 store 0x0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .blockscaled import BlockScaledFormat

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Midpoints between neighbouring magnitudes with the side a tie rounds to: RNE sends a tie to the
# even code (mantissa bit 0), which alternates down (>) and up (>=) along the grid.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(r: torch.Tensor) -> torch.Tensor:
    """Nibbles (int32, 0..15) of ``r``: round-to-nearest-even onto E2M1, saturating at +-6."""
    a = torch.nan_to_num(r.float().abs(), nan=0.0).clamp(max=E2M1_MAX)
    code = torch.zeros_like(a, dtype=torch.int32)
    for mid, tie_up in _MIDPOINTS:
        code += (a >= mid if tie_up else a > mid).int()
    return code | (torch.signbit(r).int() << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of nibbles: magnitude ``m*0.5`` for exponent 0, else ``(2+m) * 2**(e-2)``."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, m * 0.5, (m + 2) * torch.exp2((e - 2).float()))
    return torch.where((c & 8) != 0, -mag, mag)


@dataclass(frozen=True)
class NVFP4Format(BlockScaledFormat):
    def element_encode(self, r):
        return e2m1_encode(r)

    def element_decode(self, codes):
        return e2m1_decode(codes)


NVFP4 = NVFP4Format(
    "nvfp4", code=4, group_size=16, element_bits=4, qmax=E2M1_MAX, code_bits=4, calib_range=E2M1_MAX * 448.0,
    description="NVFP4: E2M1 + E4M3 scale per 16 (keys per channel over the flush, values per token)",
    tags=("thinkv",),
)
NVFP4O = NVFP4Format(
    "nvfp4o", code=8, group_size=16, element_bits=4, qmax=E2M1_MAX, code_bits=4, calib_range=E2M1_MAX * 448.0,
    key_offset=True,
    description="NVFP4 with a per-channel fp16 key midpoint subtracted before quantizing (values as nvfp4)",
    tags=("key_offset",),
)
