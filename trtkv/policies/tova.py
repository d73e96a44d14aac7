"""TOVA: Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024,
arXiv:2401.06104).

Once the cache is full, each decode step drops the token with the lowest attention score from the current
query, averaged over the layer's heads. No sinks and no protected window: any token, the newest included,
may go.

Parameters
    budget        tokens kept per layer ("multi-state size"), prompt and decode together; hard cap
    evict_every   drop tokens only every k steps (LazyEviction's windowed baseline, its Table 4); 1 = paper

Choices where the paper is not specific
    * A prompt longer than the budget is cut once after prefill with the last prompt query's attention
      (averaged over heads), rather than token by token while encoding it.
    * Eviction runs after the step's attention and makes room for the next token, so no step attends more
      than ``budget`` tokens (the paper's state holds budget+1 while attending). With ``evict_every = k`` the
      cache is cut to budget-k every k steps by the current query's scores. Ties drop the older token.
"""
from __future__ import annotations

from dataclasses import dataclass

from trtkv.policies.scored import Cadence, ScorerPolicy
from trtkv.policies.scorers.tova import TOVAScorer
from trtkv.policies.scoring import check_positive


@dataclass
class TOVAPolicy(ScorerPolicy):
    name = "tova"
    description = "drop the token with the lowest current-query attention, head-averaged (Oren et al. 2024)"
    budget: int | None = 256
    evict_every: int = 1
    hard_cap = True
    evict_protected_when_short = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(budget=self.budget, evict_every=self.evict_every)
        if self.evict_every >= self.budget:
            raise ValueError(f"tova needs evict_every < budget; got {self.evict_every} >= {self.budget}")

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.evict_every, 1)  # only the event step's attention row

    def make_scorer(self) -> TOVAScorer:
        return TOVAScorer()
