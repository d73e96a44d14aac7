"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
arXiv:2404.14469).

At the end of prefill, the last ``window_size`` prompt queries (the observation window) vote for prefix
tokens: their softmax rows are summed over the window, smoothed by 1-D pooling along the sequence (so
neighbours of a selected token come with it) and the top ``budget - window_size`` prefix tokens are kept
together with the window itself. Decode tokens are appended uncompressed, as in the paper.

Parameters
    budget         prompt capacity per layer ("max_capacity_prompt"), window included
    window_size    observation window (paper: 32)
    kernel_size    pooling kernel (paper: 7)
    pooling        "avgpool" (release default) or "maxpool"
    decode_every   0 = the paper (prefill only). N > 0: trtkv's decode-time variant: every N decode steps,
                   if the layer holds more than ``budget`` tokens, re-select ``budget`` tokens from the whole
                   cache with the same vote, the window being the last ``window_size`` decode queries
                   (their attention rows as the decode kernel produced them). Soft bound: budget + N.

Choices where the paper is not specific
    * trtkv evicts per (layer, token): the per-head votes are summed over all query heads of a layer.
    * Kernel 7 / window 32 follow the paper's experiments; the release's defaults differ (window 64,
      kernel 5, avgpool). Pooling is stride 1, zero-padded, dividing by the kernel size (PyTorch default).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.policies.base import KVPolicy, StatsRequest
from trtkv.policies.scoring import PositionTable, check_choice, check_positive, pool1d, top_keep


@dataclass
class SnapKVPolicy(KVPolicy):
    name = "snapkv"
    description = "observation-window voting + 1-D pooling at prefill; optional decode re-selection (Li et al. 2024)"
    budget: int | None = 256
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "avgpool"
    decode_every: int = 0

    def __post_init__(self) -> None:
        check_positive(budget=self.budget, window_size=self.window_size, kernel_size=self.kernel_size)
        check_choice("pooling", self.pooling, ("avgpool", "maxpool"))
        if self.decode_every < 0:
            raise ValueError(f"decode_every must be >= 0 (0: prefill only); got {self.decode_every}")
        if self.window_size >= self.budget:
            raise ValueError(f"snapkv needs window_size < budget; got {self.window_size} >= {self.budget}")

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        if self.decode_every == 0:
            return max(prompt_len, min(prompt_len, self.budget) + max_tokens)
        bound = min(prompt_len + max_tokens, self.budget + self.decode_every)
        return max(prompt_len, bound) + self.residual_group() - 1

    def _window_step(self, t: int) -> bool:
        """Is decode step ``t`` (1-based) among the last ``window_size`` steps before an event?"""
        return self.decode_every > 0 and (-t) % self.decode_every < self.window_size

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase == "prefill":
            return StatsRequest(weights=True, prefill_window=self.window_size) if req.prompt_len > self.budget \
                else None
        return StatsRequest(weights=True) if self._window_step(req.step + 1) else None

    def _select(self, req, layer: int, pos: np.ndarray, votes: torch.Tensor, window: np.ndarray) -> None:
        """Keep ``window`` plus the top prefix tokens by pooled ``votes`` (aligned with ascending ``pos``)."""
        buffered = np.asarray(req.buffered_positions(layer), dtype=np.int64)
        prefix = ~np.isin(pos, window) & ~np.isin(pos, buffered)  # buffered tokens cannot be evicted
        score = pool1d(votes[torch.from_numpy(prefix).to(votes.device)], self.kernel_size,
                       "max" if self.pooling == "maxpool" else "avg")
        n_keep = self.budget - (req.num_live(layer) - int(prefix.sum()))
        keep = top_keep(pos[prefix], score, n_keep)
        cand = pos[prefix]
        req.evict(layer, cand[~np.isin(cand, keep)])

    def on_prefill_end(self, req, stats) -> None:
        T = req.prompt_len
        if T <= self.budget:
            return
        window = np.arange(T - self.window_size, T)
        for layer, ls in stats.layers.items():
            votes = ls.weights.sum(dim=(0, 1))  # [w, Hq, T]: sum over window queries and heads
            self._select(req, layer, ls.positions, votes, window)

    def on_decode_step_end(self, req, stats) -> None:
        t = req.step
        if not self._window_step(t):
            return
        votes = req.state.get("votes")
        for layer, ls in stats.layers.items():
            if votes is None:
                votes = req.state["votes"] = PositionTable(req.num_layers, device=ls.weights.device)
            votes.add(layer, ls.positions, ls.weights.sum(0))
        if t % self.decode_every:
            return
        for layer in range(req.num_layers):
            if req.num_live(layer) > self.budget:
                paged = req.live_positions(layer)
                buf = np.asarray(req.buffered_positions(layer), dtype=np.int64)
                pos = np.sort(np.concatenate([paged, buf]))
                window = pos[-self.window_size:]
                self._select(req, layer, pos, votes.get(layer, pos), window)
        req.state.pop("votes", None)

    def on_request_finish(self, req) -> None:
        req.state.clear()
