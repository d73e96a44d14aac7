"""int8 weight-only linear, the contract of the CPU kernel: ``y = x @ (codes * scales[:, None]).T``.

``x [M, K]`` fp32, ``codes [N, K]`` int8 with one symmetric scale per output channel, ``scales [N]`` fp32 ->
``[M, N]`` fp32. The kernel reads the codes blocked by 64 output channels (``block_codes``: each block's
``[K, 64]`` codes one contiguous run, the last block zero-padded), so a decode step reads them in order. Only
the weights are quantized; activations stay fp32, so a row's result does not depend on the other rows of its
batch. The kernel sums in another order (vector lanes), so it matches to rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 64  # output channels a block


def block_codes(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` (or any per-channel rows ``[N, C]``) -> ``[ceil(N / 64), K, 64]`` (contiguous, zero-padded)."""
    N, K = codes.shape
    nb = -(-N // BLOCK)
    padded = torch.zeros(nb * BLOCK, K, dtype=codes.dtype, device=codes.device)
    padded[:N] = codes
    return padded.view(nb, BLOCK, K).transpose(1, 2).contiguous()


def unblock_codes(codes_b: torch.Tensor, n: int) -> torch.Tensor:
    """``block_codes``'s inverse: ``[N, K]``."""
    nb, K, _ = codes_b.shape
    return codes_b.transpose(1, 2).reshape(nb * BLOCK, K)[:n]


def int8_linear_ref(x: torch.Tensor, codes_b: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = unblock_codes(codes_b, scales.numel())
    return x.float() @ (codes.float() * scales.float()[:, None]).t()


class Int8Weight(NamedTuple):
    """A projection's weight as the kernel reads it: ``block_codes`` of its int8 codes, and its scales."""

    codes_b: torch.Tensor  # [ceil(N / 64), K, 64] int8
    scales: torch.Tensor  # [N] fp32

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
        return cls(block_codes(codes), scales.float().contiguous())
