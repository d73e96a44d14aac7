"""int4 weight-only linear, the contract of the CPU kernel: ``y = x @ w.T`` with ``w[n, k] = codes[n, k] *
scales[n, k // G] + mins[n, k // G]``.

``codes [N, K]`` int4 values in [0, 15] (held as uint8), ``scales, mins [N, K / G]`` fp16: one scale and one
minimum per output channel and group of ``G`` inputs (``G`` even, dividing ``K``), as llama.cpp's Q4_1 (0.625 bytes
a weight at ``G = 32``; fp32 ones cost a fifth more bytes a decode step). The kernel reads the codes
blocked by 64 output channels and packed two a byte (``Int4Weight.pack``: ``[ceil(N / 64), K / 2, 64]`` uint8, low
nibble ``k = 2i``, high nibble ``k = 2i + 1``), scales and mins blocked alike (``[ceil(N / 64), K / G, 64]``), so a
decode step reads them in order. Activations stay fp32. The kernel sums in another order (vector lanes), so it
matches to rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from plugins.int8_linear.reference import block_codes, unblock_codes  # (the same blocking by 64 channels)

class Int4Weight(NamedTuple):
    """A projection's weight as the kernel reads it."""

    codes_b: torch.Tensor  # [ceil(N / 64), K / 2, 64] uint8, two codes a byte
    scales_b: torch.Tensor  # [ceil(N / 64), K / G, 64] fp16
    mins_b: torch.Tensor  # [ceil(N / 64), K / G, 64] fp16
    n: int  # output channels

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int4Weight:
        c = codes.to(torch.uint8)
        return cls(block_codes(c[:, 0::2] | (c[:, 1::2] << 4)), block_codes(scales.half()), block_codes(mins.half()),
                   codes.shape[0])

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes [N, K] uint8, scales [N, K / G] fp16, mins [N, K / G] fp16)``."""
        byte = unblock_codes(self.codes_b, self.n)
        codes = torch.stack([byte & 0xF, byte >> 4], dim=-1).flatten(1)
        return codes, unblock_codes(self.scales_b, self.n), unblock_codes(self.mins_b, self.n)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` fp32 weights of codes ``[N, K]`` and their groups' ``scales, mins [N, K / G]``."""
    N, K = codes.shape
    G = K // scales.shape[1]
    return (codes.float().view(N, K // G, G) * scales.float()[..., None] + mins.float()[..., None]).view(N, K)


def int4_linear_ref(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    return x.float() @ dequantize(*w.unpack()).t()
