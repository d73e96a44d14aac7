"""Torch reference: token ``i`` of ``k, v [b, H, D]`` converted to the arena's dtype and stored at flat row
``at[i]`` of ``arena_k, arena_v`` viewed as ``[-1, H, D]`` (``trtkv/cache/residual.py`` computes the rows)."""
from __future__ import annotations

import torch


def residual_append_ref(arena_k: torch.Tensor, arena_v: torch.Tensor, at: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> None:
    H, D = arena_k.shape[-2:]
    b = at.numel()
    arena_k.view(-1, H, D).index_copy_(0, at, k.reshape(b, H, D).to(arena_k.dtype))
    arena_v.view(-1, H, D).index_copy_(0, at, v.reshape(b, H, D).to(arena_v.dtype))
