"""``tiered``: the semantics-aware KV memory hierarchy ("Not All Thoughts Need HBM", spec
``shared/specs/tiered-memory.md``). Cold tokens are moved to host memory, not dropped; they stay attended.

Every decode step each cached token's score grows by its attention mass, averaged over layers and query heads
(Eq. 1). Every ``interval`` steps a management event sorts the non-protected tokens by score: the lowest
``evict_ratio`` are evicted (T3), the top ``beta`` of the rest stay on device (T0), the remainder goes to host
memory: T1 (the token's own format, exact) or, with ``host_format``, T2 (re-encoded, lossy). The protected set
(the prompt, the first ``sinks`` generated tokens, the last ``window`` positions) always stays on device.
Attention covers device and host tiers alike (``runtime/staging.py``), so with ``evict_ratio=0`` the outputs
do not depend on ``beta`` (Proposition 1) beyond floating-point reduction order.

Parameters (defaults from the spec, §3): ``beta`` 0.5, ``evict_ratio`` 0.03, ``interval`` 64, ``sinks`` 4,
``window`` 128, ``host_format`` none, ``evict_accounting`` per_event.

Choices where the paper is silent or ambiguous (spec §6), all made as the spec recommends:
* A1 ``evict_ratio`` is a *per-event* fraction of the live candidates (literal Algorithm 1; evictions
  compound). ``evict_accounting=cumulative`` instead keeps |T3| = floor(r * |every candidate ever|).
  The realised eviction fraction is reported (``tiered.realised_eviction_fraction``).
* A2 offload mode is "stream": host tokens are copied to a per-layer staging buffer every step; device
  bytes include the two one-layer staging buffers (``kv_bytes_device``).
* A3 sinks are the first ``sinks`` *generated* tokens (the first sequence positions are prompt anyway).
* A4 scores are accumulated in fp32; a layer whose column sums are not finite is left out of the step's
  average; a step with no finite layer adds nothing.
* A5 promoted host tokens are copied back to the device at the event (host copy freed: a token is in one tier).
* A6 T2: ``host_format`` puts *all* offloaded tokens in T2 (the spec's ``r_comp`` in {0, 1}); the format is
  any registered KV format (``compressed`` = the measured default, ``trtkv.cache.tiers.DEFAULT_HOST_FORMAT``),
  keys and values re-encoded by the ``kv_write`` plugin in flush groups of the format's group size. T2 ->
  T0 promotion re-encodes the dequantized values in the token's device format (lossy, never restored).
* A9 ties: eviction takes the lower score, then the older position; the device keeps the higher score, then
  the newer position (stable sorts on (score, position)).
* A14 no age normalisation (old tokens have had more steps to collect score).
* A16 scores start at 0 after prefill; the event at step 0 does nothing (everything is protected).
* Tiers are per token for all layers at once (one score per position); residual-buffer tokens of quantized
  formats are never moved (they are not paged yet) and count as protected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from plugins import ops as plugin_ops
from trtkv.policies.base import (WEIGHTS, KVPolicy, ReportColumn, StatsRequest, StepBatch, StepStats,
                                  batch_blocks_of)
from trtkv.policies.request import PolicyRequest
from trtkv.policies.score_rows import RowTable, RowView
from trtkv.policies.scoring import check_choice, head_sums

ACCOUNTING = ("per_event", "cumulative")


@dataclass
class TieredState:
    score: RowView | None = None  # this request's row of the policy's [1, rows, positions] fp64 scores (Eq. 1)
    events: int = 0
    evicted: int = 0  # |T3|
    promoted: int = 0
    demoted: int = 0
    skipped_steps: int = 0  # steps with no finite layer (A4)
    candidates_ever: int = 0  # |U_all| at the last event


@dataclass
class TieredPolicy(KVPolicy):
    name = "tiered"
    description = "Tiered KV memory: cold tokens to host memory (T1/T2), still attended; bottom r evicted"
    State = TieredState
    beta: float = 0.5
    evict_ratio: float = 0.03
    interval: int = 64
    sinks: int = 4
    window: int = 128
    host_format: str = "none"
    evict_accounting: str = "per_event"

    def __post_init__(self) -> None:
        from trtkv.cache.tier_names import parse_host_format

        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if not 0.0 <= self.evict_ratio < 1.0:
            raise ValueError(f"evict_ratio must be in [0, 1), got {self.evict_ratio}")
        if self.interval < 1 or self.window < 1 or self.sinks < 0:
            raise ValueError("interval and window must be >= 1 and sinks >= 0")
        check_choice("evict_accounting", self.evict_accounting, ACCOUNTING)
        fmt = parse_host_format(self.host_format, what="--set host_format")
        self._host_tier = "host" if fmt is None else f"host-{fmt}"
        # every request's score row (host memory, as the spec's fp64 sums): a step accumulates the batch at once
        self._scores = RowTable(1, dtype=torch.float64)

    # --- engine-facing --------------------------------------------------------------------------
    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        """Device-resident tokens at worst: protected + one interval of new tokens + beta of the rest."""
        bound = prompt_len + self.sinks + self.window + self.interval + math.ceil(self.beta * max_tokens)
        return min(prompt_len + max_tokens, bound)

    def min_device_tokens(self, prompt_len: int, max_tokens: int) -> int:
        return min(prompt_len + max_tokens, prompt_len + self.sinks + self.window + self.interval)

    @classmethod
    def report_columns(cls) -> tuple[ReportColumn, ...]:
        return (ReportColumn("events", "tiered.events", ".0f"),
                ReportColumn("T3 frac", "tiered.realised_eviction_fraction", ".3f"))

    # --- hooks ------------------------------------------------------------------------------------
    batch_stats = True  # a decode step's accumulation for the whole batch (on_decode_step_end_batch)
    batch_weights = False  # of the weights' sums over heads

    def on_request_init(self, req: PolicyRequest) -> None:
        req.state.score = self._scores.acquire()

    def on_request_finish(self, req: PolicyRequest) -> None:
        if req.state.score is not None:
            req.state.score.release()
            req.state.score = None

    def scores(self, req: PolicyRequest) -> np.ndarray:
        """The request's accumulated score of every position (0 past the last one scored)."""
        return req.state.score.values(0).numpy()

    def stats_request(self, req: PolicyRequest, phase: str) -> StatsRequest | None:
        return WEIGHTS if phase == "decode" else None

    def on_decode_step_end(self, req: PolicyRequest, stats: StepStats) -> None:
        self._accumulate(req, stats)
        if stats.step % self.interval == 0:
            self._event(req, stats.step)

    def on_decode_step_end_batch(self, reqs: list[PolicyRequest], stats: list[StepStats]) -> None:
        """Every request's accumulation, then the events due, decided and moved for the batch at once (a request's
        scores and moves touch no other request's: the order of requests is free)."""
        if stats and stats[0].batch is not None:
            self._accumulate_batch(reqs, stats[0].batch, np.fromiter((st.row for st in stats), np.int64, len(stats)))
        else:
            for req, st in zip(reqs, stats):
                self._accumulate(req, st)
        due = [(req, st.step) for req, st in zip(reqs, stats) if st.step % self.interval == 0]
        due_reqs = [req for req, _ in due]
        decided = self._decide_many(due_reqs, [t for _, t in due]) if due else []
        moves = [(req, m) for req, m in zip(due_reqs, decided) if m is not None]
        for i, tier in enumerate(("evicted", "device", self._host_tier)):  # the batch's moves, layer by layer
            jobs = [(req, m[i]) for req, m in moves if len(m[i])]
            if jobs:
                reqs[0].place_many(None, jobs, tier)

    def _accumulate(self, req: PolicyRequest, stats: StepStats) -> None:
        """Eq. 1: s_i += mean over finite layers of (1/H) sum_h alpha_{l,h}[i]."""
        st = req.state
        parts = []
        for ls in stats.layers.values():
            if ls.weights is None or not len(ls.positions):
                continue
            col = head_sums(ls).float()
            if not bool(torch.isfinite(col).all()):
                continue
            parts.append((np.asarray(ls.positions, np.int64), col.double()))
        if not parts:
            st.skipped_steps += 1
            return
        denom = len(parts) * req.num_q_heads
        for p, v in parts:  # (layer by layer, in fp64: the batch path adds in the same order)
            st.score.add(0, p, v.cpu() / denom)

    def _accumulate_batch(self, reqs: list[PolicyRequest], batch: dict, rows: np.ndarray) -> None:
        """``_accumulate`` of every request of a decode step whose statistics came in batch form (``rows[i]``:
        ``reqs[i]``'s row of them): the same sums, added layer by layer for the whole batch in one
        ``fold_add_rows`` (a layer's sources' column blocks one after the other: a position is in one of them)."""
        layers = batch_blocks_of(batch, rows)
        blocks = [(p, sums.float().cpu()) for _, bl in layers for p, sums in bl]
        if not blocks:
            for req in reqs:
                req.state.skipped_steps += 1
            return
        # a layer counts for a row when it has columns there and all its blocks' sums in that row are finite
        finite = plugin_ops.finite_rows([s for _, s in blocks]).numpy()
        starts = np.cumsum([0] + [len(bl) for _, bl in layers[:-1]])
        live = np.logical_and.reduceat(finite, starts, axis=0) & (np.stack([c for c, _ in layers]) > 0)
        counted = live.sum(0)
        for i in np.flatnonzero(counted == 0).tolist():
            reqs[i].state.skipped_steps += 1
        # (a layer that does not count for a row adds nothing to it: its columns are skipped)
        pos = [p for p, _ in blocks] if live.all() else [
            np.where(ok[:, None], p, -1) for (_, bl), ok in zip(layers, live) for p, _ in bl]
        table_rows = np.fromiter((r.state.score.row for r in reqs), np.int64, len(reqs))
        # (fp32 / fp64 divides in fp64: the one-by-one path's col.double() / denom)
        self._scores.add_rows_folded(0, table_rows, pos, [s for _, s in blocks],
                                     np.maximum(counted, 1) * reqs[0].num_q_heads,
                                     batch.top if isinstance(batch, StepBatch) else -1)

    def _event(self, req: PolicyRequest, t: int) -> None:
        moves = self._decide(req, t)
        if moves is None:
            return
        for positions, tier in zip(moves, ("evicted", "device", self._host_tier)):
            if len(positions):
                req.place(None, positions, tier)

    def _decide(self, req: PolicyRequest, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The event's moves of one request (positions to evict, promote and demote; the counters follow them),
        or None when it has no candidates."""
        st = req.state
        P = req.prompt_len
        p_now = P + t
        alive = req.attended_positions(0)
        buffered = req.buffered_positions(0)
        prot = (alive < P + self.sinks) | (alive > p_now - self.window)
        if len(buffered):
            prot |= np.isin(alive, buffered)
        cand = alive[~prot]
        st.candidates_ever = max(0, (p_now - self.window + 1) - (P + self.sinks))
        if len(cand) == 0:
            return None
        st.events += 1
        score = st.score.get(0, cand).numpy()
        order = np.lexsort((cand, score))  # ascending score, then older first
        if self.evict_accounting == "per_event":
            n_evict = math.floor(self.evict_ratio * len(cand))
        else:
            n_evict = min(len(cand), max(0, math.floor(self.evict_ratio * st.candidates_ever) - st.evicted))
        evict = cand[order[:n_evict]]
        rest_idx = order[n_evict:]
        rest, rest_score = cand[rest_idx], score[rest_idx]
        n_dev = math.floor(self.beta * len(rest))
        keep_order = np.lexsort((-rest, -rest_score))  # descending score, then newer first
        ranked, tiers = rest[keep_order], req.tier_of(0, rest)[keep_order]
        promote = ranked[:n_dev][tiers[:n_dev] != 0]  # kept on the device, not there now
        demote = ranked[n_dev:][tiers[n_dev:] == 0]
        st.evicted += len(evict)
        st.promoted += len(promote)
        st.demoted += len(demote)
        return evict, promote, demote

    def _decide_many(self, reqs: list[PolicyRequest], steps: list[int]
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """``_decide`` of each of ``reqs`` (distinct, of one batch) at its step, by array operations over all of their
        tokens: the same moves, in the same orders, and the same counters."""
        st = [req.state for req in reqs]
        b = len(reqs)
        P = np.fromiter((req.prompt_len for req in reqs), np.int64, b)
        p_now = P + np.asarray(steps, np.int64)
        alive, n_alive = reqs[0].attended_positions_flat(0, reqs)
        owner = np.repeat(np.arange(b), n_alive)
        prot = (alive < (P + self.sinks)[owner]) | (alive > (p_now - self.window)[owner])
        prot |= reqs[0].buffered_flat(0, reqs, alive, n_alive)  # (residual-buffer tokens are never moved)
        cand, who = alive[~prot], owner[~prot]
        n_cand = np.bincount(who, minlength=b)
        ever = np.maximum(0, (p_now - self.window + 1) - (P + self.sinks))
        for s, e in zip(st, ever.tolist()):
            s.candidates_ever = e
        if not len(cand):
            return [None] * b
        rows = np.fromiter((s.score.row for s in st), np.int64, b)
        table = st[0].score.table
        score = table.take(0, table.flat(rows[who], cand)).numpy()
        order = np.lexsort((cand, score, who))  # a request's candidates together: ascending score, then older first
        start = np.cumsum(n_cand) - n_cand
        rank = np.arange(len(cand)) - start[who[order]]
        if self.evict_accounting == "per_event":
            n_evict = np.floor(self.evict_ratio * n_cand).astype(np.int64)
        else:
            done = np.fromiter((s.evicted for s in st), np.int64, b)
            n_evict = np.minimum(n_cand, np.maximum(0, np.floor(self.evict_ratio * ever).astype(np.int64) - done))
        out = rank < n_evict[who[order]]
        evict, evict_who = cand[order[out]], who[order[out]]
        rest_idx = order[~out]
        rest, rest_score, rest_who = cand[rest_idx], score[rest_idx], who[rest_idx]
        n_rest = n_cand - n_evict
        n_dev = np.floor(self.beta * n_rest).astype(np.int64)
        keep_order = np.lexsort((-rest, -rest_score, rest_who))  # descending score, then newer first
        ranked, ranked_who = rest[keep_order], rest_who[keep_order]
        on_dev = reqs[0].on_device_flat(0, reqs, rest, n_rest)[keep_order]
        to_dev = np.arange(len(ranked)) - (np.cumsum(n_rest) - n_rest)[ranked_who] < n_dev[ranked_who]
        promote, demote = to_dev & ~on_dev, ~to_dev & on_dev
        parts = [np.split(x, np.cumsum(np.bincount(w, minlength=b))[:-1])
                 for x, w in ((evict, evict_who), (ranked[promote], ranked_who[promote]),
                              (ranked[demote], ranked_who[demote]))]
        out_moves: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = []
        for i, s in enumerate(st):
            if not n_cand[i]:
                out_moves.append(None)
                continue
            e, p, d = parts[0][i], parts[1][i], parts[2][i]
            s.events += 1
            s.evicted += len(e)
            s.promoted += len(p)
            s.demoted += len(d)
            out_moves.append((e, p, d))
        return out_moves

    def extra_stats(self, req: PolicyRequest) -> dict[str, Any]:
        st = req.state
        frac = st.evicted / st.candidates_ever if st.candidates_ever else 0.0
        return {"tiered": {"events": st.events, "evicted": st.evicted, "promoted": st.promoted,
                           "demoted": st.demoted, "realised_eviction_fraction": round(frac, 5),
                           "skipped_steps": st.skipped_steps}}
