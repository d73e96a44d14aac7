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

from trtkv.policies.base import KVPolicy, StatsRequest
from trtkv.policies.scoring import check_positive, evict_lowest, lookup


@dataclass
class TOVAPolicy(KVPolicy):
    name = "tova"
    description = "drop the token with the lowest current-query attention, head-averaged (Oren et al. 2024)"
    budget: int | None = 256
    evict_every: int = 1

    def __post_init__(self) -> None:
        check_positive(budget=self.budget, evict_every=self.evict_every)
        if self.evict_every >= self.budget:
            raise ValueError(f"tova needs evict_every < budget; got {self.evict_every} >= {self.budget}")

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        return min(prompt_len + max_tokens, max(prompt_len, self.budget)) + self.residual_group() - 1

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase == "prefill":
            return StatsRequest(weights=True, prefill_window=1) if req.prompt_len > self.budget - self.evict_every \
                else None
        if (req.step + 1) % self.evict_every == 0:  # the step about to run will evict
            return StatsRequest(weights=True)
        return None

    def on_prefill_end(self, req, stats) -> None:
        self._trim(req, {l: (ls.positions, ls.weights[-1]) for l, ls in stats.layers.items()})

    def on_decode_step_end(self, req, stats) -> None:
        if req.step % self.evict_every == 0:
            self._trim(req, {l: (ls.positions, ls.weights) for l, ls in stats.layers.items()})

    def _trim(self, req, rows) -> None:
        target = self.budget - self.evict_every
        for layer, (pos, w) in rows.items():
            evict_lowest(req, layer, target, lookup(pos, w.mean(0)))
