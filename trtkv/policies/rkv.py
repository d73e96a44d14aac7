"""R-KV: redundancy-aware KV compression for reasoning models (Cai et al., 2025, arXiv:2505.24133).

Decode-time compression with a buffer: the cache is allowed to grow by ``buffer`` tokens, then it is cut
back to ``budget`` (every ``buffer`` decode steps). Each token outside the protected set gets

    Z = λ·I − (1 − λ)·R

where the importance I is the attention the last ``window_size`` queries paid to it (mean over the
window and the query heads of each KV head, then 1-D max pooling along the sequence) and the redundancy R
is the row mean of the keys' cosine-similarity matrix (zero diagonal; the most recent near-duplicates of a
token, similarity > ``sim_threshold``, are exempted so the latest copy of a repeated pattern survives),
softmax-normalised over tokens. The top ``budget − |protected|`` tokens by Z survive; the protected set
is the last ``window_size`` tokens and the first ``n_sink`` tokens. The kept tokens are gathered into a
compact cache, as the paper does (``compaction``).

Parameters
    budget          tokens kept per layer after each compression (prompt + decode); soft bound budget+buffer
    buffer          decode steps between compressions (the release's ``divide_length``: 128)
    window_size     observation window of recent queries, always kept (8)
    kernel_size     max-pooling kernel of the importance (7)
    mix_lambda      λ (0.07 in the release; the paper reports λ≈0.1 as best — we follow the release)
    retain_ratio    share of a token's near-duplicates exempted from its redundancy (release: 0.2)
    sim_threshold   cosine similarity above which two keys are near-duplicates (0.5)
    n_sink          first tokens always kept (release: ``first_tokens`` = 4)
    compaction      gather survivors into a compact cache (True, as in the paper). This is an engine cache
                    setting: builds force ``--set eviction=compact``; ``compaction=false`` runs in place.

Choices where the paper is not specific
    * trtkv evicts per (layer, token): Z is computed per KV head and averaged over the KV heads of a layer.
    * The importance uses the attention rows the decode kernel produced at the window's steps (softmax over
      the whole cache at that step, as the release computes it), not a recomputation.
    * A prompt longer than the budget is compressed once after prefill with the last ``window_size`` prompt
      queries (the release compresses whatever is in the cache when it runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.policies.base import KVPolicy, StatsRequest
from trtkv.policies.scoring import PositionTable, check_positive, group_mean, rkv_z, top_keep


def rkv_scores(req, layer: int, hist: np.ndarray, importance: torch.Tensor, mix_lambda: float, kernel: int,
               threshold: float, retain_ratio: float | None) -> torch.Tensor:
    """Z over ``hist`` positions (ascending) from importance ``[H, n]``, averaged over KV heads -> ``[n]``."""
    keys = req.keys(layer, hist).to(importance.device).transpose(0, 1)  # [H, n, D]
    return rkv_z(importance, keys, mix_lambda, kernel, threshold, retain_ratio).mean(0)


@dataclass
class RKVPolicy(KVPolicy):
    name = "rkv"
    description = "attention importance minus key redundancy, compress every buffer steps, compact (Cai et al. 2025)"
    budget: int | None = 256
    buffer: int = 128
    window_size: int = 8
    kernel_size: int = 7
    mix_lambda: float = 0.07
    retain_ratio: float = 0.2
    sim_threshold: float = 0.5
    n_sink: int = 4
    compaction: bool = True

    def __post_init__(self) -> None:
        check_positive(budget=self.budget, buffer=self.buffer, window_size=self.window_size,
                       kernel_size=self.kernel_size)
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0; got {self.n_sink}")
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must be in [0, 1]; got {self.mix_lambda}")
        if not 0.0 <= self.retain_ratio <= 1.0:
            raise ValueError(f"retain_ratio must be in [0, 1]; got {self.retain_ratio}")
        if not -1.0 <= self.sim_threshold <= 1.0:
            raise ValueError(f"sim_threshold must be in [-1, 1]; got {self.sim_threshold}")
        if self.window_size + self.n_sink >= self.budget:
            raise ValueError(f"rkv needs budget > window_size + n_sink ({self.window_size} + {self.n_sink}); "
                             f"got {self.budget}")

    def cache_eviction_mode(self) -> str | None:
        return "compact" if self.compaction else None

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        bound = min(prompt_len + max_tokens, self.budget + self.buffer)
        return max(prompt_len, bound) + self.residual_group() - 1

    def _window_step(self, t: int) -> bool:
        return (-t) % self.buffer < self.window_size

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase == "prefill":
            return StatsRequest(weights=True, prefill_window=self.window_size) if req.prompt_len > self.budget \
                else None
        return StatsRequest(weights=True) if self._window_step(req.step + 1) else None

    def on_request_init(self, req) -> None:
        req.state["events"] = 0

    def _compress(self, req, layer: int, importance_of) -> bool:
        """Cut one layer to ``budget``: protect the window and the sinks, rank the rest by Z."""
        if req.num_live(layer) <= self.budget:
            return False
        paged = req.live_positions(layer)
        buf = np.asarray(req.buffered_positions(layer), dtype=np.int64)
        pos = np.sort(np.concatenate([paged, buf]))
        protected = np.union1d(pos[: self.n_sink], pos[-self.window_size:])
        protected = np.union1d(protected, buf)
        hist = paged[~np.isin(paged, protected)]
        n_keep = self.budget - len(protected)
        if n_keep < len(hist):
            z = rkv_scores(req, layer, hist, importance_of(hist), self.mix_lambda, self.kernel_size,
                           self.sim_threshold, self.retain_ratio)
            keep = top_keep(hist, z, n_keep)
            req.evict(layer, hist[~np.isin(hist, keep)])
        return True

    def on_prefill_end(self, req, stats) -> None:
        H = req.cache.cfg.num_kv_heads
        acted = False
        for layer, ls in stats.layers.items():
            rows = group_mean(ls.weights, H).mean(0)  # [w, Hq, T] -> [H, T] (positions = 0..T-1)
            acted |= self._compress(req, layer, lambda h, r=rows: r[:, torch.as_tensor(h, device=r.device)])
        req.state["events"] += int(acted)

    def on_decode_step_end(self, req, stats) -> None:
        t = req.step
        if not self._window_step(t):
            return
        acc = req.state.get("imp")
        H = req.cache.cfg.num_kv_heads
        for layer, ls in stats.layers.items():
            if acc is None:
                acc = req.state["imp"] = PositionTable(req.num_layers, (H,), device=ls.weights.device)
            acc.add(layer, ls.positions, group_mean(ls.weights, H))
        if t % self.buffer or acc is None:
            return
        n_rows = min(self.window_size, t)
        acted = False
        for layer in range(req.num_layers):
            acted |= self._compress(req, layer, lambda h, l=layer: acc.get(l, h) / n_rows)
        req.state["events"] += int(acted)
        req.state.pop("imp", None)

    def extra_stats(self, req) -> dict:
        return {"rkv_events": req.state.get("events", 0), "cache_eviction": req.cache.cfg.eviction}

    def on_request_finish(self, req) -> None:
        req.state.clear()
