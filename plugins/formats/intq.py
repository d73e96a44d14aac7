"""KIVI-style asymmetric integers (INT4 / INT2): the paper's Table 10 ablation, and a key format
whose zero point absorbs per-channel offsets.

Keys per channel over the flush group, values per token over 16 channels, as for NVFP4. Scale and
zero are rounded to fp16 *before* encoding, and codes are computed against those rounded values so
decode (``code * scale + zero`` in fp32) is consistent with encode:

    zero  = fp16(min)             scale = fp16((max - min) / (2**bits - 1))
    code  = clamp(round_half_even((x - zero) / scale), 0, 2**bits - 1)    (0 where scale == 0)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FieldSpec, KVFormat, LayerScales
from .packing import pack, per_channel, value_groups

_FP16_MAX = 65504.0


@dataclass(frozen=True)
class IntFormat(KVFormat):
    bits: int = 4
    calib_range: float = 0.0  # no static scale: LayerScales stay 1.0

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def slot_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]:
        packed, vg = (num_heads, head_dim * self.bits // 8), (num_heads, head_dim // 16)
        return [
            FieldSpec("k", packed, torch.uint8),
            FieldSpec("v", packed, torch.uint8),
            FieldSpec("v_scale", vg, torch.float16),
            FieldSpec("v_zero", vg, torch.float16),
        ]

    def group_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]:
        return [
            FieldSpec("k_scale", (num_heads, head_dim), torch.float16),
            FieldSpec("k_zero", (num_heads, head_dim), torch.float16),
        ]

    def _params(self, lo, hi):
        scale = ((hi - lo) / self.levels).clamp(max=_FP16_MAX).half()
        return scale, lo.clamp(-_FP16_MAX, _FP16_MAX).half()

    def _codes(self, x, scale, zero):
        s = scale.float()
        q = torch.where(s > 0, torch.round((x - zero.float()) / s), torch.zeros_like(x))
        return pack(q.clamp(0, self.levels), self.bits)

    def encode(self, k, v, scales: LayerScales):
        k, v = k.float(), v.float()
        k_scale, k_zero = self._params(k.amin(0), k.amax(0))
        vg = value_groups(v)
        v_scale, v_zero = self._params(vg.amin(-1), vg.amax(-1))
        slot = {
            "k": self._codes(k, k_scale, k_zero),
            "v": self._codes(v, per_channel(v_scale), per_channel(v_zero)),
            "v_scale": v_scale,
            "v_zero": v_zero,
        }
        return slot, {"k_scale": k_scale, "k_zero": k_zero}

    def decode(self, slot, group, scales: LayerScales):
        from .lut import decode_packed, identity_codes

        vc = decode_packed(slot["v"], identity_codes, self.bits)
        v = vc * per_channel(slot["v_scale"].float()) + per_channel(slot["v_zero"].float())
        return self.decode_keys(slot, group, scales), v

    def decode_keys(self, slot, group, scales: LayerScales):
        from .lut import decode_packed, identity_codes

        kc = decode_packed(slot["k"], identity_codes, self.bits)
        return kc * group["k_scale"].float() + group["k_zero"].float()


INT4 = IntFormat(
    "int4", code=6, group_size=16, element_bits=4, bits=4,
    description="INT4 asymmetric (KIVI): fp16 scale+zero, keys per channel over the flush, values per 16",
    tags=("ablation", "key_offset"),
)
INT2 = IntFormat(
    "int2", code=7, group_size=16, element_bits=2, bits=2,
    description="INT2 asymmetric (KIVI): fp16 scale+zero, keys per channel over the flush, values per 16",
    tags=("ablation", "key_offset"),
)
