"""Random eviction: a control for the attention-scored policies (uniform random scores, seeded).

A recent study reports that uniformly random eviction comes close to strong evictors on several
benchmarks, so users want it beside them. Like TOVA it is a hard cap: once a layer is full, every
``evict_every`` steps it drops random tokens to make room for the next ones, never touching the first
``n_sink`` tokens (default 0: any token may go).

Parameters
    budget        tokens kept per layer, prompt and decode together (hard cap)
    evict_every   drop tokens every k steps (1: every step)
    n_sink        first tokens never evicted
    seed          random stream (with the decode step and layer): the same run evicts the same tokens
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.policies.scored import Cadence, ScorerPolicy
from trtkv.policies.scorers import Scorer
from trtkv.policies.scoring import check_positive


class RandomScorer(Scorer):
    """Uniform scores seeded by (seed, step, layer), not by request id: a generation is reproducible run to
    run and batching does not change it."""

    evidence_suffices = True
    name = "random"
    batches = True  # batch_rows and score_rows (it observes nothing)
    rows_any_step = True

    def __init__(self, seed: int = 0):
        self.seed = seed

    def _draw(self, step: int, layer: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1009 + layer)
        return torch.rand(n, generator=g)

    def score(self, req, layer, positions, memo, ev=None):
        return self._draw(req.step, layer, len(positions))

    def observe_batch(self, reqs, memos, batch, rows) -> None:
        pass

    def batch_rows(self, reqs, memos) -> np.ndarray:
        """The requests' steps (their scores depend on nothing else)."""
        return np.fromiter((r.step for r in reqs), np.int64, len(reqs))

    def score_rows(self, layer: int, steps: np.ndarray, positions: np.ndarray, free: np.ndarray) -> torch.Tensor:
        """``score`` of each row's candidates (``free``), drawn once for the rows of one step and as many
        candidates; the other columns get +inf (they are masked anyway)."""
        out = torch.full(positions.shape, float("inf"))
        counts = free.sum(1)
        if (steps == steps[0]).all() and (free == free[:1]).all():  # one step, one mask (the usual case)
            cols = np.flatnonzero(free[0])
            out[:, torch.from_numpy(cols)] = self._draw(int(steps[0]), layer, len(cols))
            return out
        for step, n in set(zip(steps.tolist(), counts.tolist())):
            at = np.flatnonzero((steps == step) & (counts == n))
            sub = out[torch.from_numpy(at)]
            sub[torch.from_numpy(free[at])] = self._draw(step, layer, n).repeat(len(at))
            out[torch.from_numpy(at)] = sub
        return out

    def shared_scores_layers(self, steps: np.ndarray, num_layers: int, free: np.ndarray) -> torch.Tensor | None:
        """One draw a layer over the free columns when every row is at one step (the usual case)."""
        if not (steps == steps[0]).all():
            return None
        cols = np.flatnonzero(free)
        draws = torch.stack([self._draw(int(steps[0]), layer, len(cols)) for layer in range(num_layers)])
        if len(cols) == len(free):
            return draws
        out = torch.full((num_layers, len(free)), float("inf"))
        out[:, torch.from_numpy(cols)] = draws
        return out

    def score_rows_layers(self, steps: np.ndarray, positions: np.ndarray, free: np.ndarray) -> torch.Tensor:
        """``score_rows`` of every layer: with one step and one mask for every row and layer (the usual case) each
        layer's draw is every row's (a view)."""
        shared = self.shared_scores_layers(steps, len(positions), free[0, 0]) \
            if (free == free[:1, :1]).all() else None
        if shared is None:
            return super().score_rows_layers(steps, positions, free)
        return shared[:, None, :].expand(positions.shape)


@dataclass
class RandomPolicy(ScorerPolicy):
    name = "random"
    description = "uniformly random eviction under the budget (seeded control)"
    budget: int | None = 256
    evict_every: int = 1
    n_sink: int = 0
    seed: int = 0
    hard_cap = True
    evict_protected_when_short = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(budget=self.budget, evict_every=self.evict_every)
        if not 0 <= self.n_sink < self.budget - self.evict_every:
            raise ValueError(f"random needs 0 <= n_sink < budget - evict_every; got n_sink={self.n_sink}")

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.evict_every, 0)

    def make_scorer(self) -> RandomScorer:
        return RandomScorer(self.seed)
