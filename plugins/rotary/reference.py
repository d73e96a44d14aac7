"""Torch reference of the rotary embedding (the model's definition, as transformers computes it;
``trtkv/models/decoder.py`` calls it through ``plugins.ops.rotary``, which runs the compiled CPU kernel on
plain fp32 CPU tensors: bit-identical, one pass instead of six dispatched ops)."""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]``, cos/sin ``[T, D]``: the rotated ``x``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
