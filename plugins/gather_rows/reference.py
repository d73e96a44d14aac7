"""A batch's per-position values read from a score table (H2O's accumulated attention) in every layer at once.

Contract: ``data [layers, rows, cap]`` (float32, float64 or int32), ``rows [b]`` int64 (table rows),
``positions [L, b, n]`` int64 (< cap; -1: a dead column) -> ``[L, b, n]`` of ``data``'s dtype:
``out[l, i, j] = data[layer0 + l, rows[i], positions[l, i, j]]``, 0 where the position is -1. A position past the
width is an error (on CPU; a device read skips the check, which would wait for the device).
"""
from __future__ import annotations

import torch


def gather_rows_ref(data: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, layer0: int) -> torch.Tensor:
    L, b, n = positions.shape
    R, cap = data.shape[1], data.shape[2]
    pos = positions.to(data.device)
    if data.device.type == "cpu" and pos.numel() and int(pos.max()) >= cap:
        raise RuntimeError("gather_rows: a position past the table's width")
    base = ((layer0 + torch.arange(L, device=data.device))[:, None] * R + rows.to(data.device)[None, :]) * cap
    out = data.reshape(-1).index_select(0, (base[:, :, None] + pos.clamp(min=0)).reshape(-1)).view(L, b, n)
    return out.masked_fill(pos < 0, 0)
