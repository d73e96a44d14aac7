"""H2O: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048).

Each token's score is the attention it has accumulated from every query so far (prompt queries at prefill,
then one decode query per step). The cache keeps the most recent tokens plus the "heavy hitters" with the
largest accumulated score; the paper splits the budget evenly between the two (e.g. 10% heavy + 10% recent).

Parameters
    budget          tokens kept per layer, prompt and decode together (hard cap on what any step attends)
    recent_ratio    share of the budget for the recent window (paper: 0.5, heavy:recent = 1:1)
    evict_every     evict every k decode steps instead of every step (LazyEviction's "windowed" baseline,
                    its Table 4); 1 = the paper. The cap still holds: each eviction makes room for k tokens.
    prefill_queries prompt queries whose attention seeds the scores: 0 = all of them (the paper); w > 0 =
                    only the last w, bounding the O(prompt^2) prefill statistics of very long prompts.

Choices where the paper is not specific
    * trtkv's cache evicts per (layer, token), so H2O's per-head scores are summed over all query heads of a
      layer and one keep set is chosen per layer.
    * Scores are accumulated from the prompt's full attention matrix at prefill (so a prompt longer than the
      budget is cut to heavy hitters + recent at prefill, as the paper's generation setting does), which
      costs O(prompt^2 * heads) memory per layer once (see ``prefill_queries``).
    * Eviction runs after the step's attention and makes room for the next token, so no step ever attends
      more than ``budget`` tokens (the paper momentarily holds budget+1). Ties evict the older token first.
"""
from __future__ import annotations

from dataclasses import dataclass

from trtkv.policies.base import KVPolicy, StatsRequest
from trtkv.policies.scoring import PositionTable, check_positive, evict_lowest


@dataclass
class H2OPolicy(KVPolicy):
    name = "h2o"
    description = "heavy hitters by accumulated attention + recent window, 1:1 (Zhang et al. 2023)"
    budget: int | None = 256
    recent_ratio: float = 0.5
    evict_every: int = 1
    prefill_queries: int = 0

    def __post_init__(self) -> None:
        check_positive(budget=self.budget, evict_every=self.evict_every)
        if self.prefill_queries < 0:
            raise ValueError(f"prefill_queries must be >= 0 (0: all prompt queries); got {self.prefill_queries}")
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1]; got {self.recent_ratio}")
        if self.recent + self.evict_every > self.budget:
            raise ValueError(f"h2o needs budget >= recent window + evict_every "
                             f"({self.recent} + {self.evict_every}); got budget={self.budget}")

    @property
    def recent(self) -> int:
        return int(round(self.budget * self.recent_ratio))

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        return min(prompt_len + max_tokens, max(prompt_len, self.budget)) + self.residual_group() - 1

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase == "prefill":
            w = req.prompt_len if self.prefill_queries == 0 else min(self.prefill_queries, req.prompt_len)
            return StatsRequest(weights=True, prefill_window=w)
        return StatsRequest(weights=True)  # accumulation needs every step's attention

    def on_request_init(self, req) -> None:
        req.state["acc"] = None

    def _table(self, req, device) -> PositionTable:
        if req.state.get("acc") is None:
            req.state["acc"] = PositionTable(req.num_layers, device=device)
        return req.state["acc"]

    def on_prefill_end(self, req, stats) -> None:
        for layer, ls in stats.layers.items():
            acc = self._table(req, ls.weights.device)
            acc.add(layer, ls.positions, ls.weights.sum(dim=(0, 1)))  # [w, Hq, T] -> [T]
        self._trim(req)

    def on_decode_step_end(self, req, stats) -> None:
        for layer, ls in stats.layers.items():
            self._table(req, ls.weights.device).add(layer, ls.positions, ls.weights.sum(0))
        if req.step % self.evict_every == 0:
            self._trim(req)

    def _trim(self, req) -> None:
        acc = req.state.get("acc")
        if acc is None:
            return
        target = self.budget - self.evict_every  # room for the tokens written before the next eviction
        first_recent = req.position - self.recent + 1  # the window includes the next token (req.position)
        for layer in range(req.num_layers):
            live = req.live_positions(layer)
            protect = live[live >= first_recent]
            evict_lowest(req, layer, target, lambda p, l=layer: acc.get(l, p), protect)

    def on_request_finish(self, req) -> None:
        req.state.clear()

