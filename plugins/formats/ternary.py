"""Ternary: {-1, 0, +1} elements with an E4M3 scale per 16 (spec §3.2), plus ``ternaryo`` (key offset).

2-bit sign-magnitude crumbs: 00 -> 0, 01 -> +1, 11 -> -1, and the redundant 10 ("-0") decodes to 0
but is never written. Elements round half to even, so ``|x / s_eff| = 0.5`` stores 0. The scale is
``amax`` itself (A15: the TWN 0.7*mean|x| threshold is an ablation, not this format).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .blockscaled import BlockScaledFormat


def ternary_encode(r: torch.Tensor) -> torch.Tensor:
    """Crumbs (int32) of ``round(r)`` clamped to {-1, 0, 1}."""
    q = torch.round(r.float()).clamp(-1, 1)
    return torch.where(q > 0, 1, torch.where(q < 0, 3, 0)).int()


def ternary_decode(codes: torch.Tensor) -> torch.Tensor:
    """Magnitude bit times sign: 00, 10 -> 0; 01 -> 1; 11 -> -1."""
    c = codes.to(torch.int32)
    return ((c & 1) * (1 - (c & 2))).float()


@dataclass(frozen=True)
class TernaryFormat(BlockScaledFormat):
    def element_encode(self, r):
        return ternary_encode(r)

    def element_decode(self, codes):
        return ternary_decode(codes)


TERNARY = TernaryFormat(
    "ternary", code=5, group_size=16, element_bits=2, qmax=1.0, code_bits=2, calib_range=448.0,
    description="ternary {-1,0,1} + E4M3 scale per 16 (keys per channel over the flush, values per token)",
    tags=("thinkv",),
)
TERNARYO = TernaryFormat(
    "ternaryo", code=9, group_size=16, element_bits=2, qmax=1.0, code_bits=2, calib_range=448.0,
    key_offset=True,
    description="ternary with a per-channel fp16 key midpoint subtracted before quantizing (values as ternary)",
    tags=("key_offset",),
)
