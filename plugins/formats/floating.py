"""Uncompressed formats: fp32 / fp16 / bf16, stored as-is (write-through, no residual buffer)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FieldSpec, KVFormat, LayerScales


@dataclass(frozen=True)
class FloatFormat(KVFormat):
    dtype: torch.dtype = torch.float16

    def slot_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]:
        return [FieldSpec("k", (num_heads, head_dim), self.dtype), FieldSpec("v", (num_heads, head_dim), self.dtype)]

    def encode(self, k, v, scales: LayerScales):
        return {"k": k.to(self.dtype), "v": v.to(self.dtype)}, {}

    def decode(self, slot, group, scales: LayerScales):
        return slot["k"].float(), slot["v"].float()

    def decode_keys(self, slot, group, scales: LayerScales):
        return slot["k"].float()


FP32 = FloatFormat("fp32", code=0, element_bits=32, dtype=torch.float32, description="fp32, uncompressed")
FP16 = FloatFormat("fp16", code=1, element_bits=16, dtype=torch.float16, description="fp16, uncompressed")
BF16 = FloatFormat("bf16", code=2, element_bits=16, dtype=torch.bfloat16, description="bf16, uncompressed")
