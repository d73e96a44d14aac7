"""Torch reference: attention of the decode queries over the residual buffers, merged into the pages' partial.

A quantizing policy keeps each request's last ``< g`` tokens per layer in full precision (the residual
arena, ``trtkv/cache/residual.py``). Their attention is one more partial ``(out, lse)`` that merges with
the paged formats' partials by log-sum-exp. The compiled CPU kernel (``plugins/cpu_kernels``) does both
in one call, reading the arena rows in place.
"""
from __future__ import annotations

import math

import torch

from plugins.paged_attention.reference import merge_partials


def dense_partial(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, counts: torch.Tensor, sm_scale: float):
    """Attention of ``q [b, Hq, D]`` over ``kb, vb [b, g, H, D]`` whose first ``counts[i]`` rows are live:
    ``(out [b, Hq, D], lse [b, Hq], logits [b, Hq, g])`` fp32; a request with no live row gives lse -inf, out 0."""
    b, Hq, D = q.shape
    kb, vb = kb.float(), vb.float()
    g, H = kb.shape[1], kb.shape[2]
    live = torch.arange(g, device=q.device)[None, :] < counts.to(q.device)[:, None]  # [b, g]
    qf = q.float().view(b, H, Hq // H, D)
    logits = torch.einsum("bhgd,bnhd->bhgn", qf, kb) * sm_scale
    logits = logits.masked_fill(~live[:, None, None, :], -math.inf)
    lse = torch.logsumexp(logits, -1)
    p = torch.nan_to_num(torch.exp(logits - lse.unsqueeze(-1).clamp_min(-1e30)), nan=0.0)
    out = torch.einsum("bhgn,bnhd->bhgd", p, vb).reshape(b, Hq, D)
    return out, lse.reshape(b, Hq), logits.reshape(b, Hq, g)


def buffer_attention_ref(q: torch.Tensor, arena_k: torch.Tensor, arena_v: torch.Tensor, rows: torch.Tensor,
                         layer: int, counts: torch.Tensor, sm_scale: float, out: torch.Tensor,
                         lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the pages merged with the buffers of arena rows ``rows [b]`` in ``layer``
    (``arena_k/v [rows, L, g, H, D]``, ``counts [b]`` live rows each)."""
    bo, blse, _ = dense_partial(q, arena_k[rows, layer], arena_v[rows, layer], counts, sm_scale)
    return merge_partials([(out, lse), (bo, blse)])
