"""The held columns of a batch's position-map rows in every layer, ascending: the token positions a request holds
in each layer when it holds the same number in all of them (a scoring policy's one-victim events).

Contract: ``where [layers, rows, width]`` int32 (a position's code, < 0 where the position is not held), ``rows
[k]`` int64 (position-map rows), ``n`` -> ``[layers, k, n]`` int64: row ``i`` of layer ``l`` lists the columns ``j``
with ``where[l, rows[i], j] >= 0`` in ascending order. Every such row holds exactly ``n``; otherwise an error.
"""
from __future__ import annotations

import torch


def held_columns_ref(where: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    L, _, W = where.shape
    k = rows.shape[0]
    held = where.index_select(1, rows.to(where.device)) >= 0
    if (held.sum(-1) != n).any():
        raise ValueError(f"held_columns: a row holds other than {n} columns")
    return held.reshape(-1, W).nonzero()[:, 1].view(L, k, n)
