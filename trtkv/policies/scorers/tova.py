"""TOVA's score (Oren et al. 2024): the current query's attention to each token, averaged over the layer's
query heads. Standalone it reads the decode kernel's row of the event step; under AMS, the last recomputed
row, where the current token (always kept by AMS) gets the maximum (spec ams.md §2.10)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch

from trtkv.policies.base import WEIGHTS, StatsRequest, every_row
from trtkv.policies.scoring import head_sums, lookup
from trtkv.policies.scorers.base import Scorer


@dataclass
class TOVAMemo:
    rows: dict = field(default_factory=dict)  # layer -> (positions [n], head-mean row [n]) of the latest step
    batch: dict | None = None  # or that step's statistics in batch form (layer -> BatchLayerStats) ...
    batch_row: int = -1  # ... and this request's row of them

    def __deepcopy__(self, memo) -> TOVAMemo:
        """A fork's copy: its own rows, the step's batch statistics shared (read-only, the whole batch's)."""
        return TOVAMemo(copy.deepcopy(self.rows, memo), self.batch, self.batch_row)


def tova_scores(last_row: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[..., Hq, T]`` current-query attention -> ``[..., H, T]`` (the same vector per KV head; the last slot gets
    the max)."""
    g = last_row.float().mean(-2)
    if g.shape[-1] > 1:
        g[..., -1] = g[..., :-1].amax(-1)
    return g.unsqueeze(-2).expand(*g.shape[:-1], num_kv_heads, g.shape[-1]).clone()


class TOVAScorer(Scorer):
    evidence_suffices = True
    name = "tova"
    Memo = TOVAMemo
    batches = True  # observe_batch, batch_rows and score_rows: the batch's step in one gather a layer
    batch_weights = False  # the weights' sums over heads are all it reads

    def __init__(self) -> None:
        self._batch: dict | None = None  # the latest step's statistics in batch form

    def stats_request(self, req, phase, observing):
        if not observing:
            return None
        return StatsRequest(weights=True, prefill_window=1) if phase == "prefill" else WEIGHTS

    def observe(self, req, memo, stats, phase):
        if stats.layers:
            memo.batch = None
        for layer, ls in stats.layers.items():
            memo.rows[layer] = (ls.positions, ls.weights[-1].mean(0) if phase == "prefill"
                                else head_sums(ls) / ls.weights.shape[0])

    def observe_batch(self, reqs, memos, batch: dict, rows: np.ndarray) -> None:
        """A decode step's statistics in batch form: each request keeps a reference and its row."""
        self._batch = batch
        for memo, row in zip(memos, rows.tolist()):
            memo.batch, memo.batch_row = batch, row

    def batch_rows(self, reqs, memos) -> np.ndarray:
        return np.fromiter((m.batch_row for m in memos), np.int64, len(memos))

    def score_rows(self, layer: int, rows: np.ndarray, positions: np.ndarray, free: np.ndarray) -> torch.Tensor:
        """``score`` of ``positions [k, n]``: exactly the ``n`` positions each of ``rows`` attended this step,
        ascending (what ``ScorerPolicy.events_rows`` asks) -> ``[k, n]``, the head-averaged weights in that order."""
        pos, w = _head_mean_rows(self._batch[layer], rows)
        order = np.argsort(pos, axis=1, kind="stable")[:, -positions.shape[1]:]  # (-1 sorts first)
        return torch.gather(w, 1, torch.from_numpy(order).to(w.device))

    def score_cols_layers(self, rows: np.ndarray, cols: np.ndarray) -> torch.Tensor | None:
        """The head-averaged weights of the columns themselves (no sort, no gather)."""
        stats = [self._batch[layer] for layer in range(len(cols))]
        if any(bs.positions.shape[1] != cols.shape[2] for bs in stats):
            return None
        if every_row(rows, len(stats[0].counts)) and len({bs.heads for bs in stats}) == 1:
            # one division of the stack: the same quotients as a division a layer, in one op
            return torch.stack([bs.head_sums for bs in stats]).div_(stats[0].heads)
        return torch.stack([_head_mean_rows(bs, rows)[1] for bs in stats])

    def score_evidence_rows(self, rows: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        return tova_scores(rows[:, -1], num_kv_heads).mean(-2)

    def score(self, req, layer, positions, memo, ev=None):
        if ev is not None and ev.rows is not None:
            return tova_scores(ev.rows[-1], req.num_kv_heads)
        if memo.batch is not None and layer in memo.batch:
            bs, i = memo.batch[layer], memo.batch_row
            live = bs.positions[i] >= 0
            return lookup(bs.positions[i][live], (bs.head_sums[i] / bs.heads)[torch.from_numpy(live)])(positions)
        pos, row = memo.rows[layer]
        return lookup(pos, row)(positions)


def _head_mean_rows(bs, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """Positions ``[k, n]`` and head-averaged weights ``[k, n]`` of ``rows`` of one layer's statistics in batch
    form (every row in order, a step's usual events: the arrays themselves, no gathered copy)."""
    if every_row(rows, len(bs.counts)):
        return bs.positions, bs.head_sums / bs.heads
    return bs.positions[rows], bs.head_sums[torch.from_numpy(rows)] / bs.heads
