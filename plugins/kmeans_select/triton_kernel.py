"""Triton assignment step for batched k-means selection; the rest is :func:`reference.kmeans_core`.

The distance/argmin over ``[J, M, K, F]`` is the only part that grows with features and clusters, so
it is the part fused here: one program per (job, block of rows) streams centroids and features in
tiles and keeps a running (min, argmin) per row. Distances are sums of squared differences like the
reference, ties break to the lowest cluster index, so assignments agree except on fp32 near-ties.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.kmeans_select.reference import kmeans_core


@triton.jit
def _assign_kernel(x_ptr, c_ptr, k_ptr, a_ptr, M, F, KMAX,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr):
    j = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    kj = tl.load(k_ptr + j)
    best_d = tl.full([BLOCK_M], float("inf"), tl.float32)
    best_a = tl.zeros([BLOCK_M], tl.int32)
    x_base = x_ptr + j.to(tl.int64) * M * F
    c_base = c_ptr + j.to(tl.int64) * KMAX * F
    for k0 in range(0, kj, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < kj
        d = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            fmask = offs_f < F
            x = tl.load(x_base + offs_m[:, None] * F + offs_f[None, :], mask=mmask[:, None] & fmask[None, :], other=0.0)
            c = tl.load(c_base + offs_k[:, None] * F + offs_f[None, :], mask=kmask[:, None] & fmask[None, :], other=0.0)
            diff = x[:, None, :] - c[None, :, :]
            d += tl.sum(diff * diff, axis=2)
        d = tl.where(kmask[None, :], d, float("inf"))
        dmin = tl.min(d, axis=1)
        # first index attaining the tile minimum (explicit, so the tie rule does not depend on tl.argmin)
        amin = tl.min(tl.where(d == dmin[:, None], offs_k[None, :], 2147483647), axis=1)
        better = dmin < best_d  # strict: earlier tiles win ties
        best_a = tl.where(better, amin, best_a)
        best_d = tl.where(better, dmin, best_d)
    out = j.to(tl.int64) * M + offs_m
    tl.store(a_ptr + out, best_a, mask=mmask)


def assign_triton(x: torch.Tensor, c: torch.Tensor, counts: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.assign_ref``."""
    J, M, F = x.shape
    Kmax = c.shape[1]
    a = torch.zeros((J, M), dtype=torch.int32, device=x.device)
    if J and M:
        block_m = 16
        block_k = max(2, min(16, triton.next_power_of_2(max(Kmax, 1))))
        block_f = max(16, min(64, triton.next_power_of_2(F)))
        _assign_kernel[(J, triton.cdiv(M, block_m))](
            x.contiguous(), c.contiguous(), k.to(torch.int32).contiguous(), a, M, F, Kmax,
            BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_F=block_f,
        )
    return a.long()


def kmeans_select_triton(keys: torch.Tensor, counts: torch.Tensor, k_keep: torch.Tensor, iters: int) -> torch.Tensor:
    """Same contract as ``reference.kmeans_select_ref``."""
    return kmeans_core(keys, counts, k_keep, iters, assign_triton)
