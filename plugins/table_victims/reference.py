"""The lowest-scored free position of each row of a batch, its scores read from a score table in every layer: what
``gather_rows`` then ``lowest_victim`` give, with the protection a bound on positions (a recent window).

Contract: ``data [layers, rows, cap]`` float32 or float64 (a score table; a position at or past ``cap`` was never
written and scores 0), ``rows [k]`` int64 (each request's table row), ``positions [L, k, c]`` int64 (the columns' held
positions, any order, -1 none), ``bound [k]`` int64 (positions at or past it are protected), ``layer0`` -> ``[L, k]``
int64: per layer ``layer0 + l`` and request, the position of the lowest score (compared as float32, as
``lowest_victim`` compares) among the columns with ``0 <= position < bound``. NaN counts as the lowest; ties, and
several NaNs, go to the oldest (smallest) position. -1 where no column is free or the lowest score is infinite.
"""
from __future__ import annotations

import torch

from plugins.lowest_victim.reference import lowest_victim_ref


def table_victims_ref(data: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, bound: torch.Tensor,
                      layer0: int) -> torch.Tensor:
    L, k, c = positions.shape
    if not c:  # (no columns: nothing free)
        return torch.full((L, k), -1, dtype=torch.int64, device=data.device)
    cap = data.shape[2]
    rows, positions = rows.to(data.device, torch.int64), positions.to(data.device, torch.int64)
    table = data[layer0:layer0 + L][:, rows]  # [L, k, cap]
    inside = (positions >= 0) & (positions < cap)
    scores = torch.where(inside, table.gather(2, positions.clamp(0, max(cap - 1, 0))) if cap else
                         torch.zeros(positions.shape, dtype=data.dtype, device=data.device), 0).float()
    blocked = positions >= bound.to(data.device, torch.int64)[None, :, None]
    return lowest_victim_ref(scores.reshape(L * k, c), positions.reshape(L * k, c),
                             blocked.reshape(L * k, c)).reshape(L, k)
