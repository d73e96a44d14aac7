"""SnapKV's score (Li et al. 2024): the votes of an observation window of queries (their softmax rows
summed over the window and the layer's query heads), smoothed by 1-D pooling along the candidates so a
selected token brings its neighbours."""
from __future__ import annotations

from dataclasses import dataclass

from trtkv.policies.base import WEIGHTS, StatsRequest
from trtkv.policies.scoring import PositionTable, accumulate_attention, pool1d
from trtkv.policies.scorers.base import Scorer


@dataclass
class SnapKVMemo:
    votes: PositionTable | None = None  # [L, positions] votes of the current observation window


class SnapKVScorer(Scorer):
    evidence_suffices = True
    name = "snapkv"
    Memo = SnapKVMemo

    def __init__(self, window_size: int = 32, kernel_size: int = 7, pooling: str = "avgpool"):
        self.window_size, self.kernel_size, self.pooling = window_size, kernel_size, pooling

    def stats_request(self, req, phase, observing):
        if not observing:
            return None
        return StatsRequest(weights=True, prefill_window=self.window_size) if phase == "prefill" \
            else WEIGHTS

    def observe(self, req, memo, stats, phase):
        memo.votes = accumulate_attention(memo.votes, req, stats, phase)

    def reset(self, memo):
        memo.votes = None

    def score(self, req, layer, positions, memo, ev=None):
        votes = ev.rows.float().sum(dim=(0, 1)) if ev is not None and ev.rows is not None \
            else memo.votes.get(layer, positions)
        return pool1d(votes, self.kernel_size, "max" if self.pooling == "maxpool" else "avg")
