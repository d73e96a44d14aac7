"""The lowest-scored free column of each row: a scoring policy's one-token eviction for every request and layer
of a batch at once (H2O, TOVA, ... one token over budget a step).

Contract: ``scores [M, c]`` (any float dtype), ``positions [M, c]`` int64 (-1: the column holds no token) and
``blocked [M, c]`` bool (protected: sinks, a recent window) -> ``[M]`` int64: per row, the position of the
lowest score among its columns that hold a token and are not blocked. NaN counts as the lowest score; ties, and
several NaNs, go to the oldest (smallest) position, as the first minimum over ascending positions takes it —
whatever order the columns are in. -1 where no column is free or the lowest score is infinite (the caller's
general path decides those rows).
"""
from __future__ import annotations

import torch


def lowest_victim_ref(scores: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    s = scores.float().masked_fill(blocked | (positions < 0), float("inf"))
    nan = torch.isnan(s)
    low = torch.where(nan.any(1, keepdim=True), nan, s == s.min(1, keepdim=True).values)
    at = torch.where(low, positions, torch.iinfo(torch.int64).max).argmin(1, keepdim=True)
    victims = positions.gather(1, at)[:, 0]
    return torch.where(torch.isinf(s.gather(1, at)[:, 0]), -1, victims)
