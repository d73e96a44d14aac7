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

import numpy as np

from trtkv.policies.scored import Cadence, ScorerPolicy
from trtkv.policies.scorers.h2o import H2OScorer
from trtkv.policies.scoring import check_positive


@dataclass
class H2OPolicy(ScorerPolicy):
    name = "h2o"
    description = "heavy hitters by accumulated attention + recent window, 1:1 (Zhang et al. 2023)"
    budget: int | None = 256
    recent_ratio: float = 0.5
    evict_every: int = 1
    prefill_queries: int = 0
    hard_cap = True
    evict_protected_when_short = True

    def __post_init__(self) -> None:
        super().__post_init__()
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

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.evict_every, self.evict_every)  # scores accumulate every step

    def make_scorer(self) -> H2OScorer:
        return H2OScorer(self.prefill_queries)

    def protected(self, req, layer: int, held: np.ndarray) -> np.ndarray:
        """The recent window includes the next token (``req.position``), so it protects ``recent - 1`` held."""
        return held[held >= self.protected_bound_at(req.position)]

    def protected_rows_at(self, positions: np.ndarray, held: np.ndarray) -> np.ndarray:
        """``protected`` over a stack of requests' held positions: one comparison with each row's bound."""
        return held >= self.protected_bound_at(positions)[:, None]

    def protected_cols_at(self, positions: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return self.protected_rows_at(positions, cols)  # (a bound on positions: any order; -1 is never protected)

    def protected_bound_at(self, positions):
        """The recent window's first protected position for next tokens at ``positions`` (an int or ``[k]``)."""
        return positions - self.recent + 1
