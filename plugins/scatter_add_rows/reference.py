"""A batch's per-position evidence added into a score table (H2O's accumulated attention) in every layer at once.

Contract: ``data [layers, rows, cap]`` (float32 or float64, updated in place), ``rows [b]`` int64 (the requests'
table rows, distinct), ``positions [L, b, n]`` int64 (per layer and request, distinct positions < cap; -1: skip) and
``values [L, b, n]`` (any float dtype): ``data[layer0 + l, rows[i], positions[l, i, j]] += values[l, i, j]`` for
every entry with a position, each one add in ``data``'s dtype (so the result is the same whatever the order of
entries).
"""
from __future__ import annotations

import torch


def scatter_add_rows_ref(data: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                         layer0: int) -> None:
    L, b, n = positions.shape
    R, cap = data.shape[1], data.shape[2]
    base = ((layer0 + torch.arange(L, device=data.device))[:, None] * R + rows.to(data.device)[None, :]) * cap
    flat = base[:, :, None] + positions.to(data.device)
    keep = positions.to(data.device) >= 0
    data.view(-1).index_add_(0, flat[keep], values.to(data.device, data.dtype)[keep])
