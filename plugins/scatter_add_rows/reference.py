"""A batch's per-position evidence added into a score table (H2O's accumulated attention) in every layer at once;
``fold_add_rows``: every layer's evidence added into one layer of the table (tiered's one score per token);
``finite_rows``: which rows of each block of evidence are finite (the fold leaves the others out).

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


def fold_add_rows_ref(data: torch.Tensor, rows: torch.Tensor, positions: list[torch.Tensor], values: list[torch.Tensor],
                      divisor: torch.Tensor, layer: int) -> None:
    """``data[layer, rows[i], positions[l][i, j]] += values[l][i, j] / divisor[i]`` (``positions[l], values[l]``: ``[b,
    n_l]`` each; the quotient in ``data``'s dtype; -1: skip), layer ``l`` by layer in order: what a call of
    ``scatter_add_rows_ref`` a layer at ``layer`` adds, rounding included (a position several layers hold takes their
    values one after the other)."""
    d = divisor.to(data.device, data.dtype)[:, None]
    for pos, val in zip(positions, values):
        scatter_add_rows_ref(data, rows, pos[None], (val.to(data.device, data.dtype) / d)[None], layer)


def finite_rows_ref(values: list[torch.Tensor]) -> torch.Tensor:
    """``[len(values), b]`` bool: whether every entry of row ``i`` of ``values[l]`` (``[b, n_l]``, floating point) is
    finite (an empty row is)."""
    if not values:
        return torch.empty((0, 0), dtype=torch.bool)
    return torch.stack([torch.isfinite(v).all(1).cpu() for v in values])
