"""FP8 E4M3 with a static per-(layer, K|V) fp32 tensor scale (spec §3.2): the optional R8 format.

Write-through (group_size 1): no per-group statistics, so no residual buffer and no arena entry.
Encoding divides by the tensor scale in fp32 and then rounds (RNE) with saturation at +-448.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FieldSpec, KVFormat, LayerScales
from .e4m3 import E4M3_MAX, e4m3_encode


def _t(s: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.float32, device=like.device)


@dataclass(frozen=True)
class FP8Format(KVFormat):
    calib_range: float = E4M3_MAX

    def slot_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]:
        return [FieldSpec("k", (num_heads, head_dim), torch.uint8), FieldSpec("v", (num_heads, head_dim), torch.uint8)]

    def encode(self, k, v, scales: LayerScales):
        return {"k": e4m3_encode(k.float() / _t(scales.k, k)), "v": e4m3_encode(v.float() / _t(scales.v, v))}, {}

    def decode(self, slot, group, scales: LayerScales):
        from .lut import e4m3_lookup

        k, v = e4m3_lookup(slot["k"]), e4m3_lookup(slot["v"])
        return k * _t(scales.k, k), v * _t(scales.v, v)

    def decode_keys(self, slot, group, scales: LayerScales):
        from .lut import e4m3_lookup

        k = e4m3_lookup(slot["k"])
        return k * _t(scales.k, k)

    def saturated(self, k, v, scales: LayerScales) -> tuple[torch.Tensor, torch.Tensor]:
        """Number of K and V elements clipped at 448 (0-dim tensors; no host sync)."""
        return (
            ((k.float() / _t(scales.k, k)).abs() > E4M3_MAX).sum(),
            ((v.float() / _t(scales.v, v)).abs() > E4M3_MAX).sum(),
        )


FP8 = FP8Format(
    "fp8", code=3, group_size=1, element_bits=8,
    description="FP8 E4M3 (fn, max 448) with a static per-layer fp32 tensor scale; write-through",
    tags=("thinkv",),
)
