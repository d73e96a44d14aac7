"""LazyEviction: lagged KV eviction with attention-pattern observation (Zhang et al., 2025,
arXiv:2506.15969; trtkv spec ``shared/specs/lazyeviction.md``).

Every decode step t (1-based, prefill = 0) and every layer, a token is *activated* when the step's attention
to it reaches ``alpha``; its timestamp TS becomes t and its Maximum Recurrence Interval grows to
``MRI = max(MRI, t − TS_prev)``. Only every ``window`` steps, and only when a layer holds more than
``budget`` tokens, that layer keeps its ``window`` most recent tokens plus the ``budget − window`` older
tokens with the highest MRI-centric score (spec Eq. 2)

    I = H1 + H2,   H1 = 2σ(−e/MRI),  H2 = 2σ(−MRI − 1),   e = t − TS   (MRI = 0: I = H1 = [e = 0])

ranked by the lexicographic key (I↓, MRI↑, TS↓, pos↓). After the first eviction a layer holds between
``budget`` and ``budget + window`` tokens (the soft bound; spec §3.7).

Parameters
    budget      B, tokens per layer after an eviction (prompt + decode), the window included
    window      W, eviction period = protected recent window (spec default 32 when uncalibrated; the paper
                calibrates W as the 80th percentile of MRIs: 25 GSM8K / 52 MATH-500 on DS-Llama-8B)
    alpha       activation threshold on the head-reduced attention probability (1e-4; paper: 5e-4 for
                DS-Llama-8B, 1e-4 for the Qwen family)
    head_reduce "mean" (spec default) or "max" over the layer's query heads
    score       H1/H2 shape: "sigmoid" (the paper) or the monotone [0,1] alternatives of its App. D:
                "exp" (e^-x), "tanh" (1 − tanh x), "inverse" (1/(1 + x)), with x = e/MRI for H1 and
                x = MRI + 1 for H2 (the paper does not print these formulas; these are trtkv's)
    ablate      "none", "no_h1" or "no_h2" (the paper's Table 5 ablation)

Choices (spec §7): Algorithm 1's ``B ≥ |K|`` is read as ``|S| > B``; H1 at MRI = 0 is its limit; prompt
tokens start at TS = 0, MRI = 0; a decode token starts at TS = its creation step; no prefill compression
(a longer prompt is cut at the first multiple of W). Granularity is *layer* (the spec's fallback): trtkv's
cache evicts per (layer, token), so all heads of a layer share one token set and the activation value is
the mean (or max) over all of the layer's query heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from trtkv.policies.base import StatsRequest
from trtkv.policies.scored import Cadence, ScorerPolicy
from trtkv.policies.scorers import Scorer
from trtkv.policies.scoring import PositionTable, check_choice, check_positive, head_reduce

SCORES = ("sigmoid", "exp", "tanh", "inverse")


def _decay(x: torch.Tensor, form: str) -> torch.Tensor:
    """A decreasing map [0, inf) -> (0, 1] with value 1 at 0."""
    if form == "sigmoid":
        return 2.0 * torch.sigmoid(-x)
    if form == "exp":
        return torch.exp(-x)
    if form == "tanh":
        return 1.0 - torch.tanh(x)
    return 1.0 / (1.0 + x)


def mri_score(t: int, ts: torch.Tensor, mri: torch.Tensor, form: str = "sigmoid", ablate: str = "none") -> torch.Tensor:
    """MRI-centric importance (spec §3.4), fp32. ``ts``/``mri`` are integer tensors of the same shape."""
    e = (t - ts).double()
    m = mri.double()
    h1 = torch.where(e == 0, torch.ones_like(e),
                     torch.where(m > 0, _decay(e / m.clamp(min=1), form), torch.zeros_like(e)))
    h2 = torch.where(m > 0, _decay(m + 1, form), torch.zeros_like(m))
    if ablate == "no_h1":
        h1 = torch.zeros_like(h1)
    elif ablate == "no_h2":
        h2 = torch.zeros_like(h2)
    return (h1 + h2).float()


def lexi_top(pos: np.ndarray, score: np.ndarray, mri: np.ndarray, ts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` best positions by (I desc, MRI asc, TS desc, pos desc) (spec §3.9)."""
    if k <= 0:
        return pos[:0]
    order = np.lexsort((-pos, -ts, mri, -score))
    return np.sort(pos[order[:k]])


def track(t: int, ts: torch.Tensor, mri: torch.Tensor, activated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One tracking update (spec §3.3): returns new (TS, MRI)."""
    mri = torch.where(activated, torch.maximum(mri, t - ts), mri)
    ts = torch.where(activated, torch.full_like(ts, t), ts)
    return ts, mri


@dataclass
class MRIMemo:
    ts: PositionTable | None = None  # [L, positions] step of the last activation (creation step initially)
    mri: PositionTable | None = None  # [L, positions] maximum recurrence interval


class MRIScorer(Scorer):
    """LazyEviction's tracking (every step) and MRI-centric score (at events)."""

    name = "mri"
    Memo = MRIMemo

    def __init__(self, alpha: float, head_reduce: str, form: str, ablate: str):
        self.alpha, self.head_reduce, self.form, self.ablate = alpha, head_reduce, form, ablate

    def stats_request(self, req, phase, observing):
        return StatsRequest(weights=True) if phase == "decode" else None  # tracking runs every step

    def observe(self, req, memo, stats, phase):
        t = req.step
        for layer, ls in stats.layers.items():
            if memo.ts is None:
                # TS starts at the creation step: 0 for prompt tokens, t for the token written at decode step t
                # (position P + t - 1); MRI starts at 0.
                P = req.prompt_len
                memo.ts = PositionTable(req.num_layers, dtype=torch.int64, device=ls.weights.device,
                                        init=lambda pos: (pos - P + 1).clamp(min=0))
                memo.mri = PositionTable(req.num_layers, dtype=torch.int64, device=ls.weights.device)
            a = head_reduce(ls.weights, self.head_reduce)
            idx = memo.ts.index(ls.positions)
            memo.mri.index(ls.positions)  # grow both tables alike
            ts, mri = track(t, memo.ts.data[layer, idx], memo.mri.data[layer, idx], a >= self.alpha)
            memo.ts.data[layer, idx] = ts
            memo.mri.data[layer, idx] = mri

    def score(self, req, layer, positions, memo, ev=None):
        return mri_score(req.step, memo.ts.get(layer, positions), memo.mri.get(layer, positions), self.form,
                         self.ablate)


@dataclass
class LazyEvictionPolicy(ScorerPolicy):
    name = "lazyeviction"
    description = "recurrence-interval tracking, MRI-centric score, lagged eviction every W steps (Zhang et al. 2025)"
    budget: int | None = 256
    window: int = 32
    alpha: float = 1e-4
    head_reduce: str = "mean"
    score: str = "sigmoid"
    ablate: str = "none"
    cut_prompt = False  # no prefill compression: a longer prompt is cut at the first multiple of W
    keeps_best_scores = False  # keep() is lexicographic over (I, MRI, TS, position)
    batched_events = False  # evict_layer waits for the first decode step; keep() is its own

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(budget=self.budget, window=self.window)
        if self.window >= self.budget:
            raise ValueError(f"lazyeviction needs window < budget (B >> W); got W={self.window}, B={self.budget}")
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be a finite number >= 0; got {self.alpha}")
        check_choice("head_reduce", self.head_reduce, ("mean", "max"))
        check_choice("score", self.score, SCORES)
        check_choice("ablate", self.ablate, ("none", "no_h1", "no_h2"))

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.window, self.window)

    @property
    def recent(self) -> int:
        return self.window

    def make_scorer(self) -> MRIScorer:
        return MRIScorer(self.alpha, self.head_reduce, self.score, self.ablate)

    def evict_layer(self, req, layer: int, target: int, attended=None) -> bool:
        if req.state.memo.ts is None:  # nothing tracked yet (no decode step ran)
            return False
        return super().evict_layer(req, layer, target, attended)

    def keep(self, req, layer, cand, scores, k):
        """Lexicographic (I desc, MRI asc, TS desc, position desc), spec §3.9."""
        memo = req.state.memo
        return lexi_top(cand, np.asarray(scores.cpu().numpy()), memo.mri.get(layer, cand).cpu().numpy(),
                        memo.ts.get(layer, cand).cpu().numpy(), k)
