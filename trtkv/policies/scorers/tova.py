"""TOVA's score (Oren et al. 2024): the current query's attention to each token, averaged over the layer's
query heads. Standalone it reads the decode kernel's row of the event step; under AMS, the last recomputed
row, where the current token (always kept by AMS) gets the maximum (spec ams.md §2.10)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtkv.policies.base import StatsRequest
from trtkv.policies.scoring import lookup
from trtkv.policies.scorers.base import Scorer


@dataclass
class TOVAMemo:
    rows: dict = field(default_factory=dict)  # layer -> (positions [n], row [Hq, n]) of the latest observed step


def tova_scores(last_row: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[Hq, T]`` current-query attention -> ``[H, T]`` (the same vector per KV head; the last slot gets max)."""
    g = last_row.float().mean(0)
    if g.numel() > 1:
        g[-1] = g[:-1].max()
    return g[None].expand(num_kv_heads, -1).clone()


class TOVAScorer(Scorer):
    evidence_suffices = True
    name = "tova"
    Memo = TOVAMemo

    def stats_request(self, req, phase, observing):
        if not observing:
            return None
        return StatsRequest(weights=True, prefill_window=1) if phase == "prefill" else StatsRequest(weights=True)

    def observe(self, req, memo, stats, phase):
        for layer, ls in stats.layers.items():
            memo.rows[layer] = (ls.positions, ls.weights[-1] if phase == "prefill" else ls.weights)

    def score(self, req, layer, positions, memo, ev=None):
        if ev is not None and ev.rows is not None:
            return tova_scores(ev.rows[-1], req.num_kv_heads)
        pos, row = memo.rows[layer]
        return lookup(pos, row.mean(0))(positions)
