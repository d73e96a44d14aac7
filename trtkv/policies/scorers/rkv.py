"""R-KV's score (Cai et al. 2025): ``Z = λ·maxpool(I) − (1 − λ)·R`` per KV head, averaged over the KV heads,
where the importance ``I`` is the attention an observation window of recent queries paid to each token
and the redundancy ``R`` is the row mean of the keys' cosine-similarity matrix (``scoring.rkv_z``).

Two settings, both from the sources:
* the R-KV release (the ``rkv`` policy): importance = the window's decode-kernel rows averaged over the
  window (softmax over the whole cache at each step), 20% of each token's near-duplicates exempted;
* KVPress's ``RKVPress`` (what AMS wraps, spec ams.md §2.10): importance recomputed from the last 8
  queries and renormalised over the historical (non-window) tokens, one exempted near-duplicate per row;
  the window's tokens and the first 4 get the top score.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.policies.base import WEIGHTS, BatchLayerStats, StatsRequest, batch_rows_of, positions_top
from trtkv.policies.score_rows import HeadRows, RowTable
from trtkv.policies.scoring import group_mean, rkv_z
from trtkv.policies.scorers.base import Scorer

KVPRESS_WINDOW, KVPRESS_KERNEL, KVPRESS_LAMBDA, KVPRESS_THRESHOLD = 8, 7, 0.07, 0.5


@dataclass
class RKVMemo:
    imp: HeadRows | None = None  # this request's rows (one a KV head) of the scorer's summed window attention
    rows: int = 0  # observed queries summed into ``imp``


def rkv_scores(rows: torch.Tensor, keys: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """KVPress ``RKVPress``: rows ``[w, Hq, T]`` of the last w queries, keys ``[T, H, D]`` -> ``[H, T]``."""
    w, Hq, T = rows.shape
    if T <= KVPRESS_WINDOW:
        return torch.ones(num_kv_heads, T, device=rows.device)
    n = T - w
    hist = rows[:, :, :n].float()
    hist = hist / hist.sum(-1, keepdim=True).clamp_min(1e-30)  # softmax over the historical slots only
    imp = group_mean(hist.mean(0), num_kv_heads)  # [H, n]
    z = rkv_z(imp, keys[:n].float().transpose(0, 1).to(imp.device), KVPRESS_LAMBDA, KVPRESS_KERNEL,
              KVPRESS_THRESHOLD, None)
    g = torch.empty(num_kv_heads, T, device=imp.device)
    g[:, :n] = z
    top = z.max() + 10.0
    g[:, n:] = top
    g[:, : min(4, T)] = top
    return g


class RKVScorer(Scorer):
    """The window's importance of every request lives in one ``RowTable`` (a row per request and KV head), so an
    observing decode step adds the batch's attention of every layer in one scatter; events score request by
    request (the redundancy reads each request's keys)."""
    name = "rkv"
    Memo = RKVMemo
    batches = True  # observe_batch; the policy runs its events one by one (RKVPolicy.batched_events)

    def __init__(self, window_size: int = 8, kernel_size: int = 7, mix_lambda: float = 0.07,
                 retain_ratio: float | None = 0.2, sim_threshold: float = 0.5, kvpress: bool = False):
        self.window_size, self.kernel_size, self.mix_lambda = window_size, kernel_size, mix_lambda
        self.retain_ratio, self.sim_threshold, self.kvpress = retain_ratio, sim_threshold, kvpress
        self._table: RowTable | None = None

    def _rows(self, req, memo, device) -> HeadRows:
        if memo.imp is None:
            if self._table is None:
                self._table = RowTable(req.num_layers, device)
            memo.imp = HeadRows.acquire(self._table, req.num_kv_heads)
        return memo.imp

    @property
    def evidence_suffices(self) -> bool:  # KVPress's variant reads only the wrapper's recomputed rows
        return self.kvpress

    @classmethod
    def for_ams(cls, ams):
        return cls(window_size=KVPRESS_WINDOW, kernel_size=KVPRESS_KERNEL, mix_lambda=KVPRESS_LAMBDA,
                   retain_ratio=None, sim_threshold=KVPRESS_THRESHOLD, kvpress=True)

    def stats_request(self, req, phase, observing):
        if not observing:
            return None
        return StatsRequest(weights=True, prefill_window=self.window_size) if phase == "prefill" \
            else WEIGHTS

    def observe(self, req, memo, stats, phase):
        H = req.num_kv_heads
        for layer, ls in stats.layers.items():
            imp = self._rows(req, memo, ls.weights.device)
            if phase == "prefill":  # [w, Hq, T]: the window's mean, counted as one row
                imp.add(layer, ls.positions, group_mean(ls.weights, H).mean(0))
            else:
                imp.add(layer, ls.positions, group_mean(ls.weights, H))
        if stats.layers:
            memo.rows = 1 if phase == "prefill" else min(self.window_size, max(req.step, 1))

    def observe_batch(self, reqs, memos, batch: dict[int, BatchLayerStats], rows: np.ndarray) -> None:
        """``observe`` of a decode step in batch form: row ``rows[i]`` of each layer's statistics is ``reqs[i]``'s;
        every layer's ``[b, H, n]`` group means added to the requests' head rows in one scatter."""
        if not batch:
            return
        H = reqs[0].num_kv_heads
        device = next(iter(batch.values())).weights.device
        table_rows = np.concatenate([self._rows(r, m, device).rows for r, m in zip(reqs, memos)])  # [b * H]
        layers = batch_rows_of(batch, rows, weights=True)
        if [lyr for lyr, *_ in layers] == list(range(self._table.num_layers)) and \
                len({pos.shape for _, pos, _, _ in layers}) == 1:  # every layer one width: one scatter
            pos = np.repeat(np.stack([pos for _, pos, _, _ in layers]), H, axis=1)  # [L, b * H, n]
            self._table.add_rows_layers(table_rows, pos,
                                        torch.stack([group_mean(w, H) for _, _, w, _ in layers]).flatten(1, 2),
                                        positions_top(batch, pos))
        else:
            for layer, pos, w, _ in layers:
                self._table.add_rows(layer, table_rows, np.repeat(pos, H, axis=0), group_mean(w, H).flatten(0, 1))
        for r, m in zip(reqs, memos):
            m.rows = min(self.window_size, max(r.step, 1))

    def reset(self, memo):
        self.release(memo)
        memo.rows = 0

    def release(self, memo) -> None:
        if memo.imp is not None:
            memo.imp.release()
            memo.imp = None

    def score(self, req, layer, positions, memo, ev=None):
        if self.kvpress and ev is not None and ev.rows is not None:
            return rkv_scores(ev.rows[-min(KVPRESS_WINDOW, len(ev.rows)):], ev.keys, req.num_kv_heads)
        importance = memo.imp.get(layer, positions) / memo.rows
        keys = req.keys(layer, positions).to(importance.device).transpose(0, 1)  # [H, n, D]
        return rkv_z(importance, keys, self.mix_lambda, self.kernel_size, self.sim_threshold,
                     self.retain_ratio).mean(0)
