"""The softmax weights of a batch's decode step summed over each row's query heads (what H2O accumulates and
TOVA and LazyEviction average), straight from the attention logits.

Contract: ``logits [b, Hq, n]`` (scaled, -inf at dead columns), ``lse [b, Hq]`` (their log-sum-exps; -inf for a
row with no live key, +inf never) -> ``[b, n]`` fp32: ``sum over h = 0 .. Hq-1, in that order, of
exp(logits[:, h] - lse'[:, h])`` with ``lse' = 0`` where ``lse`` is infinite (a dead row's weights are 0, not NaN).
The compiled kernel's exponential is within 2 ulp of this reference's (``codecs.h::exp_neg``); it is the one
both a batch's and a lone request's statistics take, so their decisions agree.
"""
from __future__ import annotations

import math

import torch


def head_sums_ref(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    m = lse.float().nan_to_num(nan=math.nan, posinf=0.0, neginf=0.0)
    w = torch.exp(logits.float() - m[..., None])
    out = w[:, 0].clone()
    for h in range(1, w.shape[1]):
        out += w[:, h]
    return out
