"""LazyEviction's tracking update of one decode step for a batch, in one layer or several (policies/lazyeviction.py).

Contract: ``ts, mri [layers, R, cap]`` int32, updated in place — per table row and position, TS minus the token's
creation step and the maximum recurrence interval; ``layer``; ``rows [b]`` int64 (distinct table rows);
``positions [b, n]`` int64 (distinct per row, < cap; -1: a dead column, skipped); ``values``: one fp32 ``[b, n]``
tensor, a token activated this step where ``values / divisor >= alpha`` (LazyEviction's head mean: the head sums
over the query heads; its maximum: the maximum over divisor 1); ``prompt [b]`` and ``step [b]`` int64. For every held
entry with ``created = max(pos - prompt + 1, 0)`` and ``now = step - created`` (int32): where activated,
``mri = max(mri, now - ts)`` and ``ts = now``; everything else is left as it was. ``positions`` may also be
``[L, b, n]`` with ``L`` values tensors: layer ``layer + l`` gets slice ``l`` (a step's layers in one call).
"""
from __future__ import annotations

import torch


def mri_track_ref(ts: torch.Tensor, mri: torch.Tensor, layer: int, rows: torch.Tensor, positions: torch.Tensor,
                  values: list[torch.Tensor], divisor: float, alpha: float, prompt: torch.Tensor,
                  step: torch.Tensor) -> None:
    layers = positions if positions.dim() == 3 else positions[None]
    assert len(values) == len(layers), "mri_track: one values tensor per layer of positions"
    for i, (pos, vals) in enumerate(zip(layers, values)):
        _track_layer(ts, mri, layer + i, rows, pos, (vals / divisor) >= alpha, prompt, step)


def _track_layer(ts: torch.Tensor, mri: torch.Tensor, layer: int, rows: torch.Tensor, positions: torch.Tensor,
                 act: torch.Tensor, prompt: torch.Tensor, step: torch.Tensor) -> None:
    dev = ts.device
    pos = positions.to(dev)
    hit = (pos >= 0) & act.to(dev)
    at_rows = rows.to(dev)[:, None].expand_as(pos)[hit]
    at_pos = pos[hit]
    created = (pos - prompt.to(dev)[:, None] + 1).clamp(min=0)
    now = (step.to(dev)[:, None] - created)[hit].to(ts.dtype)
    ts_l, mri_l = ts[layer], mri[layer]
    mri_l[at_rows, at_pos] = torch.maximum(mri_l[at_rows, at_pos], now - ts_l[at_rows, at_pos])
    ts_l[at_rows, at_pos] = now
