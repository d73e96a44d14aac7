"""H2O's score (Zhang et al. 2023): the attention each token has accumulated from every query so far
(prompt queries at prefill, one decode query per step), summed over the layer's query heads."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.policies.base import (WEIGHTS, BatchLayerStats, StatsRequest, StepBatch, batch_rows_of, every_row,
                                 positions_top)
from trtkv.policies.score_rows import RowTable, RowView
from trtkv.policies.scoring import accumulate_attention
from trtkv.policies.scorers.base import Scorer


@dataclass
class H2OMemo:
    acc: RowView | None = None  # this request's row of the scorer's [L, rows, positions] accumulated attention


class H2OScorer(Scorer):
    """The accumulated scores of every request live in one ``RowTable`` (a row each), so a decode step adds the
    batch's attention of a layer in one scatter and reads the batch's candidates in one gather."""
    name = "h2o"
    Memo = H2OMemo
    batches = True  # observe_batch and score_rows
    batch_weights = False  # observe_batch adds the weights' sums over heads
    rows_any_step = True  # the scores are the table's

    def __init__(self, prefill_queries: int = 0):
        self.prefill_queries = prefill_queries  # 0: every prompt query seeds the scores; w: the last w
        self._table: RowTable | None = None

    def _row(self, req, memo, device) -> RowView:
        if memo.acc is None:
            if self._table is None:
                self._table = RowTable(req.num_layers, device)
            memo.acc = self._table.acquire()
        return memo.acc

    def stats_request(self, req, phase, observing):
        if phase == "prefill":
            w = req.prompt_len if self.prefill_queries == 0 else min(self.prefill_queries, req.prompt_len)
            return StatsRequest(weights=True, prefill_window=w)
        return WEIGHTS  # accumulation needs every step's attention

    def observe(self, req, memo, stats, phase):
        if stats.layers:
            row = self._row(req, memo, next(iter(stats.layers.values())).weights.device)
            accumulate_attention(row, req, stats, phase)

    def observe_batch(self, reqs, memos, batch: dict[int, BatchLayerStats], rows: np.ndarray) -> None:
        """``observe`` of a decode step in batch form: row ``rows[i]`` of each layer's statistics is ``reqs[i]``'s."""
        if not batch:
            return
        device = next(iter(batch.values())).head_sums.device
        table_rows = np.fromiter((self._row(r, m, device).row for r, m in zip(reqs, memos)), np.int64, len(reqs))
        layers = batch_rows_of(batch, rows)
        if [lyr for lyr, *_ in layers] == list(range(self._table.num_layers)) and \
                len({pos.shape for _, pos, _, _ in layers}) == 1:  # every layer one width: one scatter
            stacked = batch.positions_layers() if isinstance(batch, StepBatch) and every_row(
                rows, len(layers[0][3])) else None  # (every layer's positions, stacked once a step)
            pos = np.stack([pos for _, pos, _, _ in layers]) if stacked is None else stacked
            self._table.add_rows_layers(table_rows, pos, torch.stack([sums for _, _, sums, _ in layers]),
                                        positions_top(batch, pos))
            return
        for layer, pos, sums, _ in layers:
            self._table.add_rows(layer, table_rows, pos, sums)

    def batch_rows(self, reqs, memos) -> np.ndarray:
        """What ``score_rows`` takes for these requests (once a step): their table rows."""
        return np.fromiter((m.acc.row for m in memos), np.int64, len(memos))

    def score_rows(self, layer: int, rows: np.ndarray, positions: np.ndarray, free: np.ndarray) -> torch.Tensor:
        """``score`` of ``positions [k, n]`` for the ``k`` requests of ``rows`` (``batch_rows``): ``[k, n]``."""
        return self._table.get_rows(layer, rows, positions)

    def score_rows_layers(self, rows: np.ndarray, positions: np.ndarray, free: np.ndarray) -> torch.Tensor:
        return self._table.get_rows_layers(rows, positions)

    def score_cols_layers(self, rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
        return self._table.get_rows_layers(rows, cols)

    def lowest_cols_layers(self, rows: np.ndarray, cols: np.ndarray, bound: np.ndarray) -> np.ndarray:
        return self._table.lowest_rows_layers(rows, cols, bound)

    def release(self, memo) -> None:
        if memo.acc is not None:
            memo.acc.release()
            memo.acc = None

    def score(self, req, layer, positions, memo, ev=None):
        return memo.acc.get(layer, positions)
