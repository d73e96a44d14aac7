"""A decode step's K/V rows into the residual arena: compiled CPU kernel vs the torch reference, bit for bit
(both round to nearest even). The arena's slot arithmetic is covered by tests/test_cache_properties.py."""
from __future__ import annotations

import pytest
import torch

from plugins.cpu_kernels.ops import residual_append_cpu
from plugins.residual_append.reference import residual_append_ref
from cpu_marks import needs_kernels


def case(dtype, b=5, rows=4, L=3, g=16, H=3, D=64, extra_heads=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    arena = torch.randn(2, rows, L, g, H, D, generator=gen).to(dtype)
    # K and V as the runtime passes them: column slices of a wider product (batch stride != H * D)
    wide = torch.randn(b, H + extra_heads, D, generator=gen) * 1e3
    k, v = wide[:, :H], wide[:, extra_heads:]
    at = torch.randperm(rows * L * g, generator=gen)[:b]
    return arena[0].clone(), arena[1].clone(), at, k, v


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference_bit_for_bit(dtype):
    ak, av, at, k, v = case(dtype)
    k = k.clone()
    k[0, 0, :3] = torch.tensor([float("inf"), 1e6, 6.1e-5])  # overflow to inf in fp16, a subnormal edge
    want_k, want_v = ak.clone(), av.clone()
    residual_append_ref(want_k, want_v, at, k, v)
    residual_append_cpu(ak, av, at, k, v)
    assert torch.equal(ak, want_k) and torch.equal(av, want_v)


@needs_kernels
def test_rejects_rows_outside_the_arena():
    ak, av, at, k, v = case(torch.float16)
    at[0] = ak.numel() // (3 * 64)
    with pytest.raises(RuntimeError, match="out of range"):
        residual_append_cpu(ak, av, at, k, v)
