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

from plugins import ops as plugin_ops
from trtkv.policies.base import WEIGHTS, BatchLayerStats, StepBatch, batch_rows_of, every_row, positions_top
from trtkv.policies.score_rows import RowTable, RowView
from trtkv.policies.scored import Cadence, ScorerPolicy
from trtkv.policies.scorers import Scorer
from trtkv.policies.scoring import check_choice, check_positive, head_reduce, head_sums

SCORES = ("sigmoid", "exp", "tanh", "inverse")


def _decay_(x: torch.Tensor, form: str) -> torch.Tensor:
    """A decreasing map [0, inf) -> (0, 1] with value 1 at 0, computed in place of ``x`` (an event scores every
    layer's candidates at once: a temporary each op would cost more than its arithmetic)."""
    if form == "sigmoid":
        return x.neg_().sigmoid_().mul_(2.0)  # 2 sigmoid(-x)
    if form == "exp":
        return x.neg_().exp_()  # exp(-x)
    if form == "tanh":
        return x.tanh_().neg_().add_(1.0)  # 1 - tanh(x)
    return torch.reciprocal(x.add_(1.0), out=x)  # 1 / (1 + x)


def mri_score(t: int, ts: torch.Tensor, mri: torch.Tensor, form: str = "sigmoid", ablate: str = "none") -> torch.Tensor:
    """MRI-centric importance (spec §3.4), fp32: ``h1 + h2`` with ``h1 = 1`` where ``e = t - ts`` is 0, else
    ``decay(e / max(mri, 1))`` where ``mri > 0``, else 0; ``h2 = decay(mri + 1)`` where ``mri > 0``, else 0 (in
    float64). ``ts``/``mri`` are integer tensors of the same shape; ``t`` an int or a tensor that broadcasts to them
    (one step per row)."""
    e = (t - ts).double()
    m = mri.double()
    none = m <= 0
    fresh = e == 0
    h1 = _decay_(e.div_(m.clamp(min=1)), form).masked_fill_(none, 0.0).masked_fill_(fresh, 1.0)
    h2 = _decay_(m.add_(1.0), form).masked_fill_(none, 0.0)
    if ablate == "no_h1":
        h1.zero_()
    elif ablate == "no_h2":
        h2.zero_()
    return h1.add_(h2).float()


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


def created_at(positions, prompt_len: int | np.ndarray):
    """The step that created each position: 0 for prompt tokens, ``t`` for the token written at decode step
    ``t`` (position ``P + t - 1``). Works on tensors and numpy arrays; ``prompt_len`` broadcasts."""
    created = positions - prompt_len + 1
    return created.clamp(min=0) if isinstance(created, torch.Tensor) else np.maximum(created, 0)


@dataclass
class MRIMemo:
    # this request's rows of the scorer's [L, rows, positions] tables: TS minus the creation step (0 until
    # the first activation, so a new row needs no initialisation) and the maximum recurrence interval
    ts: RowView | None = None
    mri: RowView | None = None
    prompt_len: int = 0


class MRIScorer(Scorer):
    """LazyEviction's tracking (every step) and MRI-centric score (at events). Every request's TS and MRI live
    in two ``RowTable``s (a row each), so a decode step's tracking runs for the whole batch a layer at once."""

    name = "mri"
    Memo = MRIMemo
    batches = True  # observe_batch; its events run request by request (LazyEvictionPolicy.batched_events)

    def __init__(self, alpha: float, head_reduce: str, form: str, ablate: str):
        self.alpha, self.head_reduce, self.form, self.ablate = alpha, head_reduce, form, ablate
        self._ts: RowTable | None = None
        self._mri: RowTable | None = None

    def _rows(self, req, memo: MRIMemo, device) -> None:
        if memo.ts is None:
            if self._ts is None:
                self._ts = RowTable(req.num_layers, device, torch.int32)  # (steps and intervals < 2**31)
                self._mri = RowTable(req.num_layers, device, torch.int32)
            memo.ts, memo.mri, memo.prompt_len = self._ts.acquire(), self._mri.acquire(), req.prompt_len
            # both tables acquire, release and copy rows in pairs, so a request's row is one index into both
            assert memo.ts.row == memo.mri.row, "TS and MRI rows out of step"

    def stats_request(self, req, phase, observing):
        return WEIGHTS if phase == "decode" else None  # tracking runs every step

    def observe(self, req, memo, stats, phase):
        t = req.step
        for layer, ls in stats.layers.items():
            self._rows(req, memo, ls.weights.device)
            pos = ls.positions
            created = created_at(torch.from_numpy(np.asarray(pos, np.int64)), memo.prompt_len).to(memo.ts.device)
            ts, mri = track(t, memo.ts.get(layer, pos) + created, memo.mri.get(layer, pos),
                            self._reduced(ls) >= self.alpha)
            memo.ts.set(layer, pos, ts - created)
            memo.mri.set(layer, pos, mri)

    def _reduced(self, ls) -> torch.Tensor:
        """A step's ``[n]`` weights reduced over query heads: the mean from the statistics' own sums (as the batch
        form's), the maximum from the per-head weights."""
        return head_reduce(ls.weights, "max") if self.head_reduce == "max" else head_sums(ls) / ls.weights.shape[0]

    @property
    def batch_weights(self) -> bool:
        return self.head_reduce == "max"  # the mean comes from the weights' sums over heads

    def observe_batch(self, reqs, memos, batch: dict[int, BatchLayerStats], rows: np.ndarray) -> None:
        """``observe`` of a decode step in batch form (row ``rows[i]`` of each layer's statistics is ``reqs[i]``'s):
        every request's held tokens updated where activated by ``mri_track`` (plugins/mri_track), one call for all
        layers when they come stacked (``StepBatch.positions_layers``), else one per layer."""
        if not batch:
            return
        first = next(iter(batch.values()))
        device, heads = (first.weights if self.batch_weights else first.head_sums).device, first.heads
        for r, m in zip(reqs, memos):
            self._rows(r, m, device)
        table_rows = torch.from_numpy(np.fromiter((m.ts.row for m in memos), np.int64, len(memos)))
        prompt = torch.from_numpy(np.fromiter((m.prompt_len for m in memos), np.int64, len(memos)))
        step = torch.from_numpy(np.fromiter((r.step for r in reqs), np.int64, len(reqs)))
        layers = batch_rows_of(batch, rows, weights=self.head_reduce == "max")
        stacked = batch.positions_layers() if isinstance(batch, StepBatch) and every_row(rows, len(first.counts)) \
            and [lyr for lyr, *_ in layers] == list(range(len(layers))) else None
        divisor = 1.0 if self.head_reduce == "max" else float(heads)  # activated: value / divisor >= alpha
        values = [w.amax(1) if self.head_reduce == "max" else w for _, _, w, _ in layers]
        if stacked is not None:
            self._track(0, table_rows, stacked, values, divisor, prompt, step, positions_top(batch, stacked))
            return
        for (layer, pos, _, counts), vals in zip(layers, values):
            if counts.any():  # (else no position in this layer)
                self._track(layer, table_rows, pos, [vals], divisor, prompt, step, positions_top(batch, pos))

    def _track(self, layer: int, table_rows, pos: np.ndarray, values: list[torch.Tensor], divisor: float, prompt,
               step, top: int) -> None:
        self._ts.ensure(top)
        self._mri.ensure(top)
        plugin_ops.mri_track(self._ts.data, self._mri.data, layer, table_rows,
                             torch.from_numpy(np.ascontiguousarray(pos, np.int64)), values, divisor, self.alpha,
                             prompt, step)

    def rows_of(self, layer: int, memos: list[MRIMemo], positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(TS, MRI)`` ``[k, n]`` of ``positions [k, n]`` of the ``k`` requests of ``memos``, in one read each."""
        rows = np.fromiter((m.ts.row for m in memos), np.int64, len(memos))
        prompt = np.fromiter((m.prompt_len for m in memos), np.int64, len(memos))[:, None]
        flat_ts, flat_mri = self._ts.flat(rows, positions).reshape(-1), self._mri.flat(rows, positions).reshape(-1)
        created = torch.from_numpy(created_at(positions, prompt)).to(self._ts.device)
        return (self._ts.take(layer, flat_ts).view(positions.shape) + created,
                self._mri.take(layer, flat_mri).view(positions.shape))

    def rows_of_layers(self, memos: list[MRIMemo], positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows_of`` of every layer at once: ``(TS, MRI)`` ``[L, k, n]`` of ``positions [L, k, n]``."""
        rows = torch.from_numpy(np.fromiter((m.ts.row for m in memos), np.int64, len(memos)))
        prompt = np.fromiter((m.prompt_len for m in memos), np.int64, len(memos))[:, None]
        self._ts.ensure(int(positions.max(initial=0)))
        self._mri.ensure(int(positions.max(initial=0)))
        at = (torch.arange(positions.shape[0])[:, None, None], rows[None, :, None], torch.from_numpy(positions))
        created = torch.from_numpy(created_at(positions, prompt[None])).to(self._ts.device)
        return self._ts.data[at] + created, self._mri.data[at]

    def ts(self, memo: MRIMemo, layer: int, positions) -> torch.Tensor:
        """TS of ``positions`` (the step of their last activation, or their creation step)."""
        created = created_at(torch.from_numpy(np.asarray(positions, np.int64)), memo.prompt_len)
        return memo.ts.get(layer, positions) + created.to(memo.ts.device)

    def release(self, memo) -> None:
        if memo.ts is not None:
            memo.ts.release()
            memo.mri.release()
            memo.ts = memo.mri = None

    def score(self, req, layer, positions, memo, ev=None):
        return mri_score(req.step, self.ts(memo, layer, positions), memo.mri.get(layer, positions), self.form,
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

    def events_each(self, due: list) -> None:
        """The events of several requests at one step, layer by layer: the requests over the budget with nothing
        buffered and the same number of held tokens are scored and ranked as one stack (``lexi_top``'s order per
        row, ``np.lexsort`` along rows) and evicted in one ``evict_flat``; the others go through ``evict_layer``."""
        if len(due) < 2 or any(r.state.memo.ts is None for r in due):
            return super().events_each(due)
        first = due[0]
        memos = [r.state.memo for r in due]
        step = torch.from_numpy(np.fromiter((r.step for r in due), np.int64, len(due)))[:, None]
        if self._events_stacked(due, memos, step):
            return
        acted = np.zeros(len(due), bool)
        for layer in range(first.num_layers):
            target = self.target(first, layer)
            live = first.num_live_many(layer, due)
            over = np.flatnonzero(live > target)
            if not len(over):
                continue
            acted[over] = True
            paged = first.num_paged_many(layer, due)
            whole = over[paged[over] == live[over]]  # nothing buffered: the held tokens are the paged ones
            owners, victims_of, lens = [], [], []
            for n in np.unique(live[whole]).tolist():
                at = whole[live[whole] == n]
                n_cand = n - min(self.recent, n)  # the newest `recent` held are protected (n_sink = 0)
                n_keep = target - (n - n_cand)
                if n_keep >= n_cand:
                    continue
                cand = first.live_positions_each(layer, due, at, n)[:, :n_cand]
                ts, mri = self.scorer.rows_of(layer, [memos[i] for i in at.tolist()], cand)
                score = mri_score(step[torch.from_numpy(at)].to(ts.device), ts, mri, self.score, self.ablate)
                order = np.lexsort((-cand, -ts.cpu().numpy(), mri.cpu().numpy(), -score.cpu().numpy()), axis=-1)
                victims = np.sort(np.take_along_axis(cand, order[:, max(n_keep, 0):], 1), axis=1)
                owners += [due[i] for i in at.tolist()]
                victims_of.append(victims.reshape(-1))
                lens.append(np.full(len(at), victims.shape[1], np.int64))
            if owners:
                first.evict_flat(layer, owners, np.concatenate(victims_of), np.concatenate(lens))
            for i in np.setdiff1d(over, whole).tolist():
                self.evict_layer(due[i], layer, target)
        for r, a in zip(due, acted.tolist()):
            r.state.events += int(a)
            self.scorer.reset(r.state.memo)

    def _events_stacked(self, due: list, memos: list[MRIMemo], step: torch.Tensor) -> bool:
        """``events_each`` when every request holds the same number of tokens in every layer, all paged, over the
        same target (the steady state of a batch in lockstep): every layer's candidates scored and ranked as one
        ``[L, k, n]`` stack, then each layer's victims evicted in one call. False (nothing done) otherwise."""
        first = due[0]
        L = first.num_layers
        targets = {self.target(first, layer) for layer in range(L)}
        live = first.num_live_layers(due)
        n = int(live[0, 0])
        if len(targets) != 1 or not (live == n).all() or not (first.num_paged_layers(due) == n).all():
            return False
        target = targets.pop()
        n_cand = n - min(self.recent, n)  # the newest `recent` held are protected (n_sink = 0)
        n_keep = target - (n - n_cand)
        if n <= target or n_keep >= n_cand:
            return False
        cand = first.live_positions_layers(due, n)[:, :, :n_cand]
        ts, mri = self.scorer.rows_of_layers(memos, cand)
        score = mri_score(step[None].to(ts.device), ts, mri, self.score, self.ablate)
        order = np.lexsort((-cand, -ts.cpu().numpy(), mri.cpu().numpy(), -score.cpu().numpy()), axis=-1)
        victims = np.sort(np.take_along_axis(cand, order[..., max(n_keep, 0):], -1), axis=-1)
        first.evict_rows_layers(due, victims)
        for r in due:
            r.state.events += 1
            self.scorer.reset(r.state.memo)
        return True

    def keep(self, req, layer, cand, scores, k):
        """Lexicographic (I desc, MRI asc, TS desc, position desc), spec §3.9."""
        memo = req.state.memo
        return lexi_top(cand, np.asarray(scores.cpu().numpy()), memo.mri.get(layer, cand).cpu().numpy(),
                        self.scorer.ts(memo, layer, cand).cpu().numpy(), k)
