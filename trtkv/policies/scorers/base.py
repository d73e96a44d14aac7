"""The scorer layer: "how important is each cached token", separated from "when and how many to evict".

A :class:`Scorer` turns a request's evidence into one score per candidate token (higher = keep). Who calls
it decides everything else: :class:`~trtkv.policies.scored.ScorerPolicy` adds protection of sinks and a
recent window, a cadence and top-k eviction (H2O, TOVA, SnapKV, R-KV, random, PyramidKV are such
policies), and AMS (``trtkv/policies/ams.py``) wraps *any* scorer with its mass-segmented quotas. This is
kvpress's ``ScorerPress`` idea on trtkv's paged cache.

Evidence comes from two places:
* the scorer's own observations of the decode kernel's attention statistics (``stats_request`` /
  ``observe``), accumulated in its per-request ``Memo`` across the steps its caller marks as observing;
* an :class:`Evidence` a wrapper recomputed at the event (AMS: the softmax rows of the last recorded
  queries over every held token, and the queries themselves).
A scorer uses the wrapper's evidence when given and its own observations otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from trtkv.policies.base import StatsRequest, StepStats

if TYPE_CHECKING:
    from trtkv.policies.request import PolicyRequest


@dataclass
class Evidence:
    """What a wrapper recomputed for one layer at an event (empty for a standalone scorer policy)."""

    rows: torch.Tensor | None = None  # [w, Hq, T] softmax rows of the last w recorded queries over `positions`
    queries: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, q [Hq, D]), oldest first
    values: torch.Tensor | None = None  # [T, H, D] fp32 values of `positions` (keys come from ``keys``)
    keys: torch.Tensor | None = None  # [T, H, D] fp32 post-RoPE keys of `positions`


@dataclass
class NoMemo:
    """The memo of a scorer that remembers nothing between steps."""


class Scorer:
    """Scores cached tokens. Subclasses set ``name`` and override ``score`` (and the observation hooks)."""

    name: ClassVar[str] = ""
    Memo: ClassVar[type] = NoMemo
    evidence_suffices: ClassVar[bool] = False  # a wrapper's Evidence is all it needs (no per-step observing)
    # batches: defines observe_batch(reqs, memos, batch, rows), so a decode step's statistics go through it for
    # the batch; and, unless the policy runs its events one by one, batch_rows(reqs, memos) -> handle and
    # score_rows(layer, handle[sel], positions [k, n], free [k, n]) -> [k, n] (``free``: the candidates, the
    # rest are masked after), so one-victim events go through it too (scorers/h2o.py)
    batches: ClassVar[bool] = False
    # observe_batch reads the batch form's per-head weights; False: only their sums over heads (``head_sums``)
    batch_weights: ClassVar[bool] = True
    # score_rows reads what the scorer keeps (not only a step's statistics in batch form): one-victim events
    # may take the batch path whichever way the step's statistics came
    rows_any_step: ClassVar[bool] = False

    def bind_model(self, arch: Any) -> None:
        """The model architecture, for scorers that need RoPE or head geometry (called once)."""

    def new_memo(self) -> Any:
        return self.Memo()

    def stats_request(self, req: PolicyRequest, phase: str, observing: bool) -> StatsRequest | None:
        """Attention statistics wanted this step; ``observing`` says whether the caller counts this step
        (or this prefill) as evidence for its next event."""
        return None

    def observe(self, req: PolicyRequest, memo: Any, stats: StepStats, phase: str) -> None:
        """Take this step's statistics (only the layers asked for; empty when nothing was asked)."""

    def reset(self, memo: Any) -> None:
        """After an event: forget a window's evidence (scorers that accumulate forever keep it)."""

    def release(self, memo: Any) -> None:
        """The request is gone: give back what its memo holds outside itself (a row of a shared table)."""

    def score(self, req: PolicyRequest, layer: int, positions: np.ndarray, memo: Any,
              ev: Evidence | None = None) -> torch.Tensor | np.ndarray:
        """Scores of ``positions [n]`` (ascending) in one layer: ``[n]`` or per KV head ``[H, n]``."""
        raise TypeError(f"scorer {type(self).__name__} does not define score()")

    def score_cols_layers(self, handle: np.ndarray, cols: np.ndarray) -> torch.Tensor | None:
        """Scores ``[L, k, c]`` of every layer's statistics columns in batch form (``cols``: their positions in slot
        order, -1 dead, any value there), or None when the scorer only scores ascending positions."""
        return None

    def lowest_cols_layers(self, handle: np.ndarray, cols: np.ndarray, bound: np.ndarray) -> np.ndarray | None:
        """Each row's victim over every layer's statistics columns ``cols [L, k, c]`` read straight from the scorer's
        own scores: the lowest-scored position below ``bound [k]`` (``score_cols_layers`` then ``lowest_victim``'s
        rules, -1 none), ``[L, k]``; None when the scorer has no such read."""
        return None

    def score_rows_layers(self, handle: np.ndarray, positions: np.ndarray, free: np.ndarray) -> torch.Tensor:
        """``score_rows`` of layer ``l`` at ``positions[l]`` for every layer: ``[L, k, n]`` (a batching scorer
        may answer in one read)."""
        return torch.stack([self.score_rows(layer, handle, positions[layer], free[layer])
                            for layer in range(len(positions))])

    def shared_scores_layers(self, handle: np.ndarray, num_layers: int, free: np.ndarray) -> torch.Tensor | None:
        """Scores ``[num_layers, n]`` that every row of ``score_rows_layers`` would get when each row's ``n`` held
        positions are scored by column alone (``free [n]``: the candidate columns, +inf at the others), or None when
        rows may differ. A batch's one-victim events then take one victim column a layer (the random control)."""
        return None

    def score_evidence_rows(self, rows: torch.Tensor, num_kv_heads: int) -> torch.Tensor | None:
        """``score`` of several requests' layers from their recomputed evidence alone, ``rows [k, w, Hq, T]`` ->
        ``[k, T]`` (``head_mean`` of each one's scores), or None when a scorer needs more than the rows."""
        return None

    @classmethod
    def for_ams(cls, ams: Any) -> Scorer:
        """The instance AMS uses (its spec fixes some scorers' settings); default: the plain scorer."""
        return cls()


def head_mean(scores) -> torch.Tensor | np.ndarray:
    """``[H, n]`` per-KV-head scores -> ``[n]`` (mean over heads); ``[n]`` passes through."""
    if isinstance(scores, torch.Tensor) and scores.dim() == 2:
        return scores.mean(0)
    return scores
