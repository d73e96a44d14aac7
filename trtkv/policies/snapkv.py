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

from trtkv.policies.scored import Cadence, ScorerPolicy
from trtkv.policies.scorers.snapkv import SnapKVScorer
from trtkv.policies.scoring import check_choice, check_positive


@dataclass
class SnapKVPolicy(ScorerPolicy):
    name = "snapkv"
    description = "observation-window voting + 1-D pooling at prefill; optional decode re-selection (Li et al. 2024)"
    budget: int | None = 256
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "avgpool"
    decode_every: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(budget=self.budget, window_size=self.window_size, kernel_size=self.kernel_size)
        check_choice("pooling", self.pooling, ("avgpool", "maxpool"))
        if self.decode_every < 0:
            raise ValueError(f"decode_every must be >= 0 (0: prefill only); got {self.decode_every}")
        if self.window_size >= self.budget:
            raise ValueError(f"snapkv needs window_size < budget; got {self.window_size} >= {self.budget}")

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.decode_every, self.window_size)  # every = 0: prefill selection only

    @property
    def recent(self) -> int:
        return self.window_size

    def make_scorer(self) -> SnapKVScorer:
        return SnapKVScorer(self.window_size, self.kernel_size, self.pooling)

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        if self.decode_every == 0:
            return max(prompt_len, min(prompt_len, self.max_layer_budget()) + max_tokens)
        return super().max_live_tokens(prompt_len, max_tokens)
