"""H2O's score (Zhang et al. 2023): the attention each token has accumulated from every query so far
(prompt queries at prefill, one decode query per step), summed over the layer's query heads."""
from __future__ import annotations

from dataclasses import dataclass

from trtkv.policies.base import StatsRequest
from trtkv.policies.scoring import PositionTable, accumulate_attention
from trtkv.policies.scorers.base import Scorer


@dataclass
class H2OMemo:
    acc: PositionTable | None = None  # [L, positions] accumulated attention


class H2OScorer(Scorer):
    name = "h2o"
    Memo = H2OMemo

    def __init__(self, prefill_queries: int = 0):
        self.prefill_queries = prefill_queries  # 0: every prompt query seeds the scores; w: the last w

    def stats_request(self, req, phase, observing):
        if phase == "prefill":
            w = req.prompt_len if self.prefill_queries == 0 else min(self.prefill_queries, req.prompt_len)
            return StatsRequest(weights=True, prefill_window=w)
        return StatsRequest(weights=True)  # accumulation needs every step's attention

    def observe(self, req, memo, stats, phase):
        memo.acc = accumulate_attention(memo.acc, req, stats, phase)

    def score(self, req, layer, positions, memo, ev=None):
        return memo.acc.get(layer, positions)
