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

from trtkv.policies.scored import Cadence, ScorerPolicy
from trtkv.policies.scorers.rkv import RKVScorer
from trtkv.policies.scoring import check_positive


@dataclass
class RKVPolicy(ScorerPolicy):
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
    batched_events = False  # its cuts are many tokens a request, scored on each request's keys: one by one

    def __post_init__(self) -> None:
        super().__post_init__()
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

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.buffer, self.window_size)

    @property
    def recent(self) -> int:
        return self.window_size

    def make_scorer(self) -> RKVScorer:
        return RKVScorer(self.window_size, self.kernel_size, self.mix_lambda, self.retain_ratio, self.sim_threshold)

    def cache_eviction_mode(self) -> str | None:
        return "compact" if self.compaction else None

    def extra_stats(self, req) -> dict:
        return {"rkv_events": req.state.events, "cache_eviction": req.eviction_mode}
