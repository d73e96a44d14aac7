"""Torch reference for batched k-means token selection (spec §4.4): which tokens of a segment survive.

All (request, layer, segment) jobs of a step run as one padded batch. Everything is batched over jobs
(no per-job Python loop) and deterministic: centroid sums are a batched one-hot matmul rather than
``scatter_add`` (atomics would reorder fp32 sums on GPU), ties break to the lowest index. The Triton
path reuses :func:`kmeans_core` and swaps in its own distance/assignment step.
"""
from __future__ import annotations

from typing import Callable

import torch

AssignFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_CHUNK_ELEMS = 1 << 24  # bound on the [J, M, k, F] difference tensor the reference materializes


def assign_ref(x: torch.Tensor, c: torch.Tensor, counts: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Nearest live centroid per row, ``[J, M]`` int64 (first index on ties).

    Squared Euclidean distance as a sum of squared differences (not the ``|x|^2 - 2xc + |c|^2``
    expansion, which cancels badly for nearby keys). Clusters ``>= k[j]`` are never chosen.
    """
    J, M, F = x.shape
    Kmax = c.shape[1]
    step = max(1, _CHUNK_ELEMS // max(1, J * M * F))
    d = torch.cat(
        [((x[:, :, None, :] - c[:, None, i : i + step, :]) ** 2).sum(-1) for i in range(0, Kmax, step)], dim=2
    ) if Kmax else x.new_zeros(J, M, 0)
    dead = torch.arange(Kmax, device=x.device)[None, :] >= k[:, None]  # [J, Kmax]
    d = d.masked_fill(dead[:, None, :], float("inf"))
    return d.argmin(dim=2) if Kmax else torch.zeros(J, M, dtype=torch.long, device=x.device)


def kmeans_core(keys: torch.Tensor, counts: torch.Tensor, k_keep: torch.Tensor, iters: int,
                assign: AssignFn) -> torch.Tensor:
    """Selection with a pluggable assignment step; see :func:`kmeans_select_ref` for the contract."""
    keys = keys.float()
    J, M, F = keys.shape
    dev = keys.device
    counts = counts.long().clamp(0, M)
    K = k_keep.long().clamp_min(0)
    Kmax = int(K.max()) if J else 0
    noop = counts <= K  # m <= K: keep every row
    kk = torch.where(noop, torch.zeros_like(K), K)  # clusters actually run (0 for no-op jobs)
    rows = torch.arange(M, device=dev)
    row_ok = rows[None, :] < counts[:, None]  # [J, M]
    keys = torch.where(row_ok[:, :, None], keys, torch.zeros_like(keys))  # padding may hold anything
    kidx = torch.arange(Kmax, device=dev)
    clu_ok = kidx[None, :] < kk[:, None]  # [J, Kmax]

    # init: K rows evenly spaced in time, floor(i*m/K)
    init = (kidx[None, :] * counts[:, None]) // kk.clamp_min(1)[:, None]
    c = (torch.gather(keys, 1, init.clamp(0, max(M - 1, 0))[:, :, None].expand(J, Kmax, F)) if M
         else keys.new_zeros(J, Kmax, F))
    a = assign(keys, c, counts, kk)
    done = ~(clu_ok.any(1))
    for _ in range(iters):
        if bool(done.all()):
            break
        onehot = ((a[:, None, :] == kidx[None, :, None]) & row_ok[:, None, :] & clu_ok[:, :, None]).float()
        n = onehot.sum(2, keepdim=True)  # [J, Kmax, 1]
        c_new = torch.where(n > 0, torch.bmm(onehot, keys) / n.clamp_min(1), c)  # empty cluster keeps its centroid
        c = torch.where(done[:, None, None], c, c_new)
        a_new = assign(keys, c, counts, kk)
        changed = ((a_new != a) & row_ok).any(1)
        a = torch.where(done[:, None], a, a_new)
        done = done | ~changed

    # distance to the own centroid, in fp64 so every implementation ranks members identically: a 2-member
    # cluster's members are equidistant in exact arithmetic, and an fp32 sum's order (SIMD width, GEMM
    # blocking) would break that tie differently per kernel; in fp64 only the centroid's own fp32 rounding,
    # identical everywhere for a 2-member sum, decides
    own = torch.gather(c, 1, a.clamp(0, max(Kmax - 1, 0))[:, :, None].expand(J, M, F)) if Kmax else keys
    dmin = ((keys.double() - own.double()) ** 2).sum(-1)

    # representative per cluster: its member nearest the centroid (first on ties)
    member = (a[:, None, :] == kidx[None, :, None]) & row_ok[:, None, :] & clu_ok[:, :, None]  # [J, Kmax, M]
    score = torch.where(member, dmin[:, None, :], torch.full_like(dmin[:, None, :], float("inf")))
    rep = score.argmin(2) if M else torch.zeros(J, Kmax, dtype=torch.long, device=dev)  # [J, Kmax]
    keep = torch.zeros(J, M + 1, dtype=torch.bool, device=dev)
    keep.scatter_(1, torch.where(member.any(2), rep, torch.full_like(rep, M)), True)
    keep = keep[:, :M]

    # top up to exactly K with the unselected rows farthest from their centroid (stable: low index first)
    need = kk - keep.sum(1)
    far = torch.where(keep | ~row_ok, torch.full_like(dmin, -float("inf")), dmin)
    order = torch.sort(far, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, rows[None, :].expand(J, M).contiguous())
    keep = keep | (row_ok & (rank < need[:, None]))
    keep = torch.where(noop[:, None], row_ok, keep)

    # ascending indices, -1 padded to Kmax
    pos = torch.where(keep, rows[None, :], torch.full_like(rows[None, :], M))
    pos = torch.sort(pos, dim=1).values
    out = torch.full((J, Kmax), -1, dtype=torch.long, device=dev)
    w = min(M, Kmax)
    out[:, :w] = torch.where(pos[:, :w] < M, pos[:, :w], torch.full_like(pos[:, :w], -1))
    return out


def kmeans_select_ref(keys: torch.Tensor, counts: torch.Tensor, k_keep: torch.Tensor, iters: int) -> torch.Tensor:
    """Per job, the rows that survive k-means with ``K = k_keep[j]`` clusters.

    Args:
        keys: ``[J, M, F]`` fp32 features (dequantized post-RoPE keys, heads concatenated), padded.
        counts: ``[J]`` int32 valid rows per job; k_keep: ``[J]`` int32 clusters per job.
        iters: at most this many Lloyd iterations; a job stops once its assignments repeat.
    Returns:
        ``[J, max(k_keep)]`` int64: ``min(counts[j], k_keep[j])`` distinct row indices in ascending
        order, then -1. ``counts[j] <= k_keep[j]`` keeps every row.
    """
    return kmeans_core(keys, counts, k_keep, iters, assign_ref)
