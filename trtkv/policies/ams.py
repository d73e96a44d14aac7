"""AMS: Adaptive Mass-Segmented KV compression (Yang & Shen, 2026; trtkv spec ``shared/specs/ams.md``).

A scorer-agnostic wrapper that changes only the *selection* of a periodic compressor. Every ``interval``
decode steps, each layer holding more than ``budget`` (= T_keep) tokens is cut to exactly T_keep:

1. usage evidence: the last W decode queries' softmax rows over the cache, averaged over the window,
   1-D average-pooled (kernel ``k_pool``) over the non-window slots and group-averaged to KV heads; the W
   window slots are padded with the maximum observed usage (``pad_mode``); mass ``m = N(u)`` (spec §2.3);
2. EMA credit ``c ← λc + (1−λ)m`` and ``m_used = N(β·m + (1−β)·N(c))`` (§2.4);
3. the cache is cut into segments that each hold about ``delta`` of the mass, split above ``l_max`` and
   merged below ``l_min`` (§2.5);
4. sinks (``n_sink``) and a recent suffix (``n_last``) are kept; every segment gets ``min(q_min, capacity)``
   and the rest of the budget in proportion to its mass (round half to even, round-robin fix-up; §2.6);
5. inside each segment the top-``q_i`` slots by the plug-in ``scorer`` survive (§2.7); the others are
   evicted and the cache is gathered and compacted (``compaction``, engine setting ``eviction=compact``).

Scorers (spec §2.10): ``tova`` (current query's attention, mean over all query heads), ``expected_attention``
(Expected Attention, Gaussian future queries from the buffered queries, averaged RoPE over ``ea_n_future``
positions, times ‖v‖), ``keydiff`` (−cos to the mean key direction), ``rkv`` (R-KV with the KVPress settings:
window 8, max-pool 7, λ = 0.07, similarity threshold 0.5, one exempted near-duplicate per row).

Parameters (``preset="paper"``: Table 15; ``preset="code"``: the release's defaults; an explicit value wins)
    budget      T_keep, tokens per layer after an event. Soft bound: max(prompt, T_keep) + interval.
    interval    I, decode steps between events (512)         hs      query buffer HS (256)
    delta       segment mass Δ (paper 0.1 / code 0.02)        l_min, l_max   segment length bounds (16/256; 32/1024)
    q_min       per-segment minimum quota (1 / 8)             lam, beta      EMA decay λ, mixing β (.9/.9; .8/.7)
    window      evidence window W (128 / 32)                  n_sink, n_last must-keep sinks / suffix (4 / 32)
    k_pool      usage pooling kernel (5)                      use_credit     EMA credit on (True)
    mode        "reserve" (paper: must-keep first, quotas guaranteed) or "reference" (release semantics)
    pad_mode    "max" (paper), "mean" or "none" for the W window slots' usage
    ablation    "none", "global_topk", "no_mass", "fixed_segments" (128 tokens) or "no_credit" (Table 7)
    ea_n_future, ea_epsilon, ea_drop   Expected Attention: 512 future positions, ε = 0.01, drop the first 4
                buffered queries (the release's quirk, kept by default per spec A8)
    compaction  gather survivors into a compact cache (True: the paper's gather-and-compact)

Choices forced by trtkv or where the paper is silent
    * trtkv's cache evicts per (layer, token), not per (layer, KV head): the per-KV-head masses N(u_h) are
      averaged over the layer's KV heads (still a distribution), the credit is kept per layer, and the
      scorer's per-head scores are averaged over KV heads. One keep set per layer; the spec's per-head
      selection would need per-head block tables.
    * Window evidence is recomputed at the event from the buffered post-RoPE queries (at their true
      positions, spec A7) against the current keys with the causal mask; with no eviction inside a window
      this equals the rows the decode kernel produced (spec §4.3, a test).
    * Queries are the engine's (bias included for Qwen2; the release drops the q bias in EA, A8); EA's
      future-position origin is the next absolute position (A8 recommendation).
    * Not implemented: ``quota_adjust="waterfill"``, ``paper_split``, the TriAttention and window scorers.
    * ``scorer`` may name any registered scorer (``trtkv/policies/scorers``): AMS hands it the recomputed
      window evidence (rows, queries, K, V); a scorer that needs its own per-step observations (e.g. ``h2o``)
      is fed the decode statistics of the evidence window as well.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from trtkv.policies.ams_queries import EventQueries, QueryLog
from trtkv.policies.ams_selection import (allocate, ams_select, fixed_segments, must_keep, segment,  # noqa: F401
                                          select)
from trtkv.policies.ams_selection_rows import ams_keep_rows
from trtkv.policies.base import KVPolicy, StatsRequest
from trtkv.policies.score_rows import RowTable, RowView
from trtkv.policies.scored import Cadence
from trtkv.policies.scorers import SCORERS, Evidence, head_mean
from trtkv.policies.scorers.expected_attention import (ea_log_expectation, expected_attention_scores,  # noqa: F401
                                                       rope_average, unrotate)
from trtkv.policies.scorers.keydiff import keydiff_scores  # noqa: F401
from trtkv.policies.scorers.rkv import KVPRESS_WINDOW, rkv_scores  # noqa: F401
from trtkv.policies.scorers.tova import tova_scores  # noqa: F401
from trtkv.policies.scoring import check_choice, check_positive, group_mean, normalize_mass, pool1d

PRESETS = {
    "paper": dict(delta=0.1, l_min=16, l_max=256, q_min=1, lam=0.9, beta=0.9, window=128),
    "code": dict(delta=0.02, l_min=32, l_max=1024, q_min=8, lam=0.8, beta=0.7, window=32),
}
SCORER_ALIASES = {"expected": "expected_attention"}
QUERIES = StatsRequest(queries=True)  # what a scorer that reads only the evidence needs of an observed step
KEEP_CHUNK = 1024  # rows (request × layer) an event's selection takes per call


# --- evidence -------------------------------------------------------------------------------------------
def window_rows(queries: torch.Tensor, q_pos: np.ndarray, keys: torch.Tensor, pos: np.ndarray,
                sm_scale: float) -> torch.Tensor:
    """Softmax rows ``[..., w, Hq, T]`` of queries ``[..., w, Hq, D]`` over keys ``[..., T, H, D]`` with the causal
    mask ``pos[j] <= q_pos[w]`` (what the decode kernel computed at those steps when nothing was evicted since).
    Leading dims: several requests' layers at once (``q_pos [..., w]``, ``pos [..., T]``)."""
    *lead, w, Hq, D = queries.shape
    T, H = keys.shape[-3:-1]
    g = Hq // H
    # one matmul per (request, KV head): [w * g, D] @ [D, T], as one bmm over [request x head] with the keys
    # transposed in place (a [T, D] row-major operand: no copy of them; einsum's own layout is ~2x slower here)
    qh = queries.float().view(*lead, w, H, g, D).movedim(-3, -4).reshape(-1, w * g, D)
    kh = keys.float().to(qh.device).movedim(-3, -2).reshape(-1, T, D)  # [... x H, T, D]
    logits = torch.bmm(qh, kh.transpose(1, 2)).view(*lead, H, w, g, T).movedim(-4, -3).contiguous().mul_(sm_scale)
    pos = np.asarray(pos)
    q_pos = np.asarray(q_pos)
    late = (pos > q_pos.min(-1, keepdims=True)).reshape(-1, T).any(0)  # the columns a causal mask can reach
    if late.any():
        c0 = int(late.argmax())
        masked = torch.as_tensor(pos[..., None, c0:] > q_pos[..., :, None], device=qh.device)  # [..., w, T - c0]
        logits[..., c0:].masked_fill_(masked[..., :, None, None, :], -math.inf)
    return torch.softmax(logits, -1).reshape(*lead, w, Hq, T)


def usage(rows: torch.Tensor, num_kv_heads: int, k_pool: int, pad_mode: str = "max") -> torch.Tensor:
    """Usage evidence ``u [..., H, T]`` from the window's rows ``[..., W, Hq, T]`` (spec §2.3 steps 4–7)."""
    *lead, W, Hq, T = rows.shape
    a = rows.float().mean(-3)  # [..., Hq, T]
    nw = T - W
    u_nw = group_mean(pool1d(a[..., :nw], k_pool, "avg"), num_kv_heads)  # [..., H, T - W]
    if nw <= 0:
        pad = u_nw.new_full((*lead, 1, 1), 0.0 if pad_mode == "none" else 1.0)
    elif pad_mode == "max":
        pad = u_nw.amax((-2, -1), keepdim=True)
    elif pad_mode == "mean":
        pad = u_nw.mean((-2, -1), keepdim=True)
    else:
        pad = u_nw.new_zeros((*lead, 1, 1))
    return torch.cat([u_nw, pad.expand(*lead, num_kv_heads, W)], dim=-1)


def _groups_by(idx: np.ndarray, T: np.ndarray, n_rec: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
    """``idx`` grouped by equal ``(T, n_rec)``: ``(members, T, n_rec)`` each, members ascending, groups in the order
    of their first member."""
    if not len(idx):
        return []
    key = T.astype(np.int64) * (int(n_rec.max()) + 1) + n_rec
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    which = which.reshape(-1)
    return [(idx[which == g], int(T[first[g]]), int(n_rec[first[g]])) for g in np.argsort(first).tolist()]


class LayerVictims:
    """An event's victims in one layer, gathered piece by piece (a request alone, or a scored group's requests with
    their victims concatenated), handed to the cache as one flat eviction."""

    def __init__(self) -> None:
        self.jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (requests, positions, counts)

    def add(self, requests, positions: np.ndarray, counts=None) -> None:
        positions = np.asarray(positions, np.int64).reshape(-1)
        counts = np.array([len(positions)]) if counts is None else counts
        self.jobs.append((np.asarray(requests, np.int64), positions, np.asarray(counts, np.int64)))

    def in_request_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(requests ascending, their victims concatenated, counts)``."""
        ids, positions, counts = (np.concatenate(x) for x in zip(*self.jobs))
        order = np.argsort(ids, kind="stable")
        if (order != np.arange(len(order))).any():
            starts = np.cumsum(counts) - counts
            n = counts[order]
            positions = positions[np.repeat(starts[order] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))]
            ids, counts = ids[order], n
        return ids, positions, counts


# --- the policy ------------------------------------------------------------------------------------
class CreditRows:
    """Every request's EMA credit in one ``RowTable``, a row each: made at the first use, when the layers and the
    device are known."""

    def __init__(self) -> None:
        self.table: RowTable | None = None

    def acquire(self, num_layers: int, device: torch.device) -> RowView:
        if self.table is None:
            self.table = RowTable(num_layers, device=device)
        return self.table.acquire()


class ScoredGroup(NamedTuple):
    """Requests of one layer an event scored together, waiting for their selection."""
    layer: int
    requests: list[int]  # indices into the event's requests
    positions: np.ndarray  # [k, T], ascending
    m_used: np.ndarray  # [k, T] the masses the segments and quotas follow
    scores: np.ndarray  # [k, T] the scorer's, for the in-segment top-k


@dataclass
class AMSState:
    queries: QueryLog = field(default_factory=QueryLog)  # the decode steps buffered since the last event
    credit: RowView | None = None  # EMA credit per layer and position: this request's row of the policy's table
    memo: Any = None  # the wrapped scorer's own observations (scorers that need them)
    events: int = 0
    noops: int = 0
    window_mass: list = field(default_factory=list)


@dataclass
class AMSPolicy(KVPolicy):
    name = "ams"
    description = "mass-segmented quotas + in-segment top-k of a plug-in scorer, gather-and-compact (Yang & Shen 2026)"
    State = AMSState
    budget: int | None = 256
    interval: int = 512
    hs: int = 256
    scorer: str = "tova"
    preset: str = "paper"
    delta: float | None = None
    l_min: int | None = None
    l_max: int | None = None
    q_min: int | None = None
    lam: float | None = None
    beta: float | None = None
    window: int | None = None
    n_sink: int = 4
    n_last: int = 32
    k_pool: int = 5
    use_credit: bool = True
    mode: str = "reserve"
    pad_mode: str = "max"
    ablation: str = "none"
    ea_n_future: int = 512
    ea_epsilon: float = 0.01
    ea_drop: int = 4
    compaction: bool = True

    def __post_init__(self) -> None:
        check_choice("preset", self.preset, tuple(PRESETS))
        self.scorer = SCORER_ALIASES.get(self.scorer, self.scorer)
        check_choice("scorer", self.scorer, tuple(SCORERS))
        for k, v in PRESETS[self.preset].items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        check_positive(budget=self.budget, interval=self.interval, l_min=self.l_min, l_max=self.l_max,
                       window=self.window, k_pool=self.k_pool, ea_n_future=self.ea_n_future)
        if not 0.0 < self.delta <= 1.0:
            raise ValueError(f"delta must be in (0, 1]; got {self.delta}")
        if not (0.0 <= self.lam <= 1.0 and 0.0 <= self.beta <= 1.0):
            raise ValueError(f"lam and beta must be in [0, 1]; got {self.lam}, {self.beta}")
        for k in ("hs", "q_min", "n_sink", "n_last", "ea_drop"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0; got {getattr(self, k)}")
        if self.ea_epsilon < 0:
            raise ValueError(f"ea_epsilon must be >= 0; got {self.ea_epsilon}")
        check_choice("mode", self.mode, ("reserve", "reference"))
        check_choice("pad_mode", self.pad_mode, ("max", "mean", "none"))
        check_choice("ablation", self.ablation, ("none", "global_topk", "no_mass", "fixed_segments", "no_credit"))
        if self.scorer == "expected_attention" and self.hs < max(self.window + 1, 8):
            raise ValueError(f"scorer=expected_attention needs hs >= max(window + 1, 8) (spec A17); got hs={self.hs}")
        self._scorer = SCORERS[self.scorer].for_ams(self)
        self._sm_scale: float | None = None
        self._credit = CreditRows()
        # (read a few times per request and step: built once, from the settings fixed above)
        self._cadence = Cadence(self.interval, max(self.n_record, 1))

    # --- engine integration ------------------------------------------------------------------
    def bind_model(self, arch) -> None:
        self._scorer.bind_model(arch)
        self._sm_scale = 1.0 / math.sqrt(arch.head_dim)

    def cache_eviction_mode(self) -> str | None:
        return "compact" if self.compaction else None

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        peak = max(prompt_len, self.budget) + self.interval  # spec §2.1 [D]
        return min(prompt_len + max_tokens, peak) + self.residual_group() - 1

    @property
    def n_buf(self) -> int:
        """Buffered decode steps at an event (the buffer is cleared at every event, capped at hs)."""
        return min(self.hs, self.interval)

    @property
    def n_record(self) -> int:
        if self.scorer == "expected_attention":
            return self.n_buf
        return min(self.n_buf, max(self.window, KVPRESS_WINDOW if self.scorer == "rkv" else 1))

    @property
    def cadence(self) -> Cadence:
        return self._cadence

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase != "decode" or not self._cadence.observing(req.step + 1):
            return None
        own = QUERIES
        if self._scorer.evidence_suffices:
            return own
        extra = self._scorer.stats_request(req, phase, True)
        return own if extra is None else StatsRequest(layers=extra.layers, weights=extra.weights,
                                                      sparsity=extra.sparsity, queries=True)

    def stats_requests(self, reqs, phase: str) -> list[StatsRequest | None]:
        """``stats_request`` of each; a scorer that needs nothing but the evidence: one shared answer."""
        if phase != "decode" or not self._scorer.evidence_suffices:
            return super().stats_requests(reqs, phase)
        observing = self._cadence.observing
        return [QUERIES if observing(r.step + 1) else None for r in reqs]

    def on_request_init(self, req) -> None:
        req.state.queries = QueryLog()
        req.state.memo = self._scorer.new_memo()

    def on_request_finish(self, req) -> None:
        if req.state.credit is not None:
            req.state.credit.release()
            req.state.credit = None

    def on_decode_step_end(self, req, stats) -> None:
        if self._record(req, stats):
            self._events([req])

    def on_decode_step_end_batch(self, reqs, stats) -> None:
        """Buffer each request's queries (and the scorer's observations), then the step's events of every request at
        once: a lockstep batch's requests all fall due together."""
        observe = None if self._scorer.evidence_suffices else self._scorer.observe
        for req, st in zip(reqs, stats):
            req.state.queries.add(req.position - 1, st)  # (the token this step wrote)
            if observe is not None:
                observe(req, req.state.memo, st, "decode")
        is_event = self._cadence.is_event
        due = [req for req in reqs if is_event(req.step)]
        if due:
            self._events(due)

    def _record(self, req, stats) -> bool:
        """Buffer the step's queries (and the scorer's observations); whether an event is due now (the one-by-one
        path; ``on_decode_step_end_batch`` does the same for a batch in one loop)."""
        req.state.queries.add(req.position - 1, stats)  # (the token this step wrote)
        if not self._scorer.evidence_suffices:
            self._scorer.observe(req, req.state.memo, stats, "decode")
        return self._cadence.is_event(req.step)

    # --- events -------------------------------------------------------------------------------
    def _events(self, reqs: list) -> None:
        """One event of each of ``reqs`` (requests of one batch). Requests holding the same number of tokens, all
        paged, with the same number of buffered queries are scored together (one evidence and mass computation
        for all of them, layer by layer); the keep sets of every layer's groups are then selected in one call per
        token count (every KEEP_CHUNK rows' worth of layers), and each layer's evictions go to the cache in one call
        (a layer's selection reads that layer's state alone, so selecting every layer before evicting any changes
        nothing)."""
        H = reqs[0].num_kv_heads
        acted = np.zeros(len(reqs), bool)
        window = EventQueries([req.state.queries for req in reqs])
        victims = [LayerVictims() for _ in range(reqs[0].num_layers)]
        scored: list[ScoredGroup] = []  # selected once they hold KEEP_CHUNK rows (a bound on the memory they hold)
        for layer in range(reqs[0].num_layers):
            T = reqs[0].num_live_many(layer, reqs)
            paged = reqs[0].num_paged_many(layer, reqs)
            over = np.flatnonzero(T > self.budget)
            n_rec = np.minimum(window.counts(layer)[over], np.maximum(self._w_eff_rows(T[over]), KVPRESS_WINDOW))
            grouped = (paged[over] == T[over]) & (n_rec > 0)
            for i in over[~grouped].tolist():  # residual-buffer tokens (never evicted) or no evidence: alone
                victims[layer].add([i], self._lone_victims(reqs[i], layer, H))
            for idx, n, m in _groups_by(over[grouped], T[over[grouped]], n_rec[grouped]):
                pos = reqs[0].live_positions_each(layer, reqs, idx, n)
                ids = idx.tolist()
                scored.append(ScoredGroup(layer, ids, pos, *self._evidence_rows(
                    layer, [reqs[i] for i in ids], pos, H, window.last(layer, ids, m))))
            if sum(len(sg.requests) for sg in scored) >= KEEP_CHUNK or layer == reqs[0].num_layers - 1:
                for sg, keeps in zip(scored, self._keep_rows(scored)):
                    victims[sg.layer].add(sg.requests, sg.positions[~keeps], (~keeps).sum(1))
                scored.clear()
        for layer, chosen in enumerate(victims):
            if chosen.jobs:
                ids, positions, counts = chosen.in_request_order()
                reqs[0].evict_flat(layer, [reqs[i] for i in ids.tolist()], positions, counts)
                acted[ids] = True
        for req, a in zip(reqs, acted.tolist()):
            if a:
                req.state.events += 1
            else:
                req.state.noops += 1  # no-op: KV and credit unchanged (spec §2.1)
            req.state.queries = QueryLog()
            self._scorer.reset(req.state.memo)

    def _lone_victims(self, req, layer: int, H: int) -> np.ndarray:
        pos = req.all_positions(layer)
        keep = self.select_layer(req, layer, pos, req.buffered_positions(layer), req.state.queries.of(layer), H)
        return np.setdiff1d(req.live_positions(layer), pos[keep])

    def _w_eff(self, T: int) -> int:
        return max(1, min(self.window, self.n_buf - 1, T - 1, self.budget))

    def _w_eff_rows(self, T: np.ndarray) -> np.ndarray:
        """``_w_eff`` of each of ``T``."""
        return np.maximum(1, np.minimum(np.minimum(T - 1, self.budget), min(self.window, self.n_buf - 1)))

    def _evidence_rows(self, layer: int, reqs: list, pos: np.ndarray, H: int,
                       queries: tuple[torch.Tensor, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``select_layer``'s evidence of requests whose tokens in ``layer`` are all paged at ``pos [k, T]``, with
        their last queries ``(q [k, m, Hq, D], positions [k, m])``: ``(m_used, scorer scores)``, ``[k, T]`` each,
        for all of them at once (updates their credit and window shares)."""
        T = pos.shape[1]
        keys = reqs[0].keys_rows(layer, reqs, pos)  # (values only for a scorer without a batch form)
        w_eff, rows_all = self.window_evidence(reqs, layer, pos, keys, queries)
        m_used = self._masses_rows(reqs, layer, pos, rows_all[:, -w_eff:], H).cpu().numpy()
        g_rows = self._scorer.score_evidence_rows(rows_all, H)
        if g_rows is None:  # a scorer without a batch form: request by request
            keys, values = reqs[0].kv_rows(layer, reqs, pos)
            g_rows = torch.stack([self._score_one(req, layer, pos[j], rows_all[j], keys[j], values[j],
                                                  (queries[0][j], queries[1][j])) for j, req in enumerate(reqs)])
        share = m_used[:, T - w_eff:].sum(1) / np.maximum(m_used.sum(1), 1e-30)
        for req, w in zip(reqs, share.tolist()):
            req.state.window_mass.append(w)
        return m_used, g_rows.cpu().numpy()

    def _keep_rows(self, scored: list[ScoredGroup]) -> list[np.ndarray]:
        """The keep masks ``[k, T]`` of ``_events``' scored groups: one ``ams_keep_rows`` for all the groups
        (of several layers) with the same token count."""
        by_T: dict[int, list[int]] = {}
        for j, sg in enumerate(scored):
            by_T.setdefault(sg.positions.shape[1], []).append(j)
        keeps: list[np.ndarray] = [np.empty(0)] * len(scored)
        for js in by_T.values():
            mu = np.concatenate([scored[j].m_used for j in js])
            g = np.concatenate([scored[j].scores for j in js])
            # (in chunks: past ~1,000 rows the temporaries' first touch costs more than the calls it saves)
            keep = np.concatenate([ams_keep_rows(mu[a:a + KEEP_CHUNK], g[a:a + KEEP_CHUNK], self.budget,
                                                 delta=self.delta, l_min=self.l_min, l_max=self.l_max,
                                                 q_min=self.q_min, n_sink=self.n_sink, n_last=self.n_last,
                                                 mode=self.mode, ablation=self.ablation)
                                   for a in range(0, len(mu), KEEP_CHUNK)])
            for j, part in zip(js, np.split(keep, np.cumsum([len(scored[j].requests) for j in js])[:-1])):
                keeps[j] = part
        return keeps

    def _score_one(self, req, layer: int, pos: np.ndarray, rows: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, queries: tuple[torch.Tensor, np.ndarray]) -> torch.Tensor:
        """The scorer's scores of one request's slots (head mean), from its evidence."""
        rec = list(zip(queries[1].tolist(), queries[0].unbind(0)))
        ev = Evidence(rows=rows, queries=rec, keys=keys, values=values)
        g = head_mean(self._scorer.score(req, layer, pos, req.state.memo, ev))
        return (g if isinstance(g, torch.Tensor) else torch.as_tensor(g)).cpu()

    def window_evidence(self, reqs: list, layer: int, pos: np.ndarray, keys: torch.Tensor,
                        queries: tuple[torch.Tensor, np.ndarray]) -> tuple[int, torch.Tensor]:
        """``evidence`` of requests with the same number of buffered queries, keys ``[k, T, H, D]`` at ``pos
        [k, T]``, their last min(buffered, max(w_eff, 8)) queries ``(q [k, m, Hq, D], positions [k, m])``:
        (w_eff, the queries' rows ``[k, m, Hq, T]``)."""
        q, q_pos = queries
        return self._w_eff(pos.shape[1]), window_rows(q, q_pos, keys, pos, self._scale(keys))

    def evidence(self, req, layer: int, pos: np.ndarray, rec: list, keys: torch.Tensor, H: int):
        """(w_eff, window rows ``[w_eff, Hq, T]``, rows of the last max(w_eff, 8) queries) for one layer."""
        T = len(pos)
        w_eff = self._w_eff(T)
        if not rec:  # hs = 0 and nothing recorded: uniform evidence
            rows = torch.full((1, H, T), 1.0 / T, device=keys.device)
            return w_eff, rows, rows
        last = rec[-max(w_eff, KVPRESS_WINDOW):]  # recorded queries, the current step's last
        q_pos = np.array([p for p, _ in last])
        rows_all = window_rows(torch.stack([q for _, q in last]), q_pos, keys, pos, self._scale(keys))
        return w_eff, rows_all[-w_eff:], rows_all

    def masses(self, req, layer: int, pos: np.ndarray, rows: torch.Tensor, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(m_cur, m_used) ``[T]`` of one layer; updates the layer's EMA credit (spec §2.3–2.4)."""
        m_cur = self._current_mass(rows, H)
        if not self._credited:
            return m_cur, m_cur
        credit = self._credit_of(req, m_cur.device)
        c = self.lam * credit.get(layer, pos) + (1 - self.lam) * m_cur  # new slots read 0 (zero-extended)
        credit.set(layer, pos, c)
        return m_cur, self._used_mass(m_cur, c)

    def _masses_rows(self, reqs: list, layer: int, pos: np.ndarray, rows: torch.Tensor, H: int) -> torch.Tensor:
        """``masses``' m_used of several requests at once: ``rows [k, w, Hq, T]`` at ``pos [k, T]`` -> ``[k, T]``."""
        m_cur = self._current_mass(rows, H)
        if not self._credited:
            return m_cur
        for req in [req for req in reqs if req.state.credit is None]:  # (their first event)
            self._credit_of(req, m_cur.device)
        table = reqs[0].state.credit.table
        flat = table.flat(np.fromiter((req.state.credit.row for req in reqs), np.int64, len(reqs)), pos).reshape(-1)
        c = self.lam * table.take(layer, flat).view(pos.shape) + (1 - self.lam) * m_cur
        table.put(layer, flat, c.reshape(-1))
        return self._used_mass(m_cur, c)

    @property
    def _credited(self) -> bool:
        return self.use_credit and self.ablation != "no_credit"

    def _current_mass(self, rows: torch.Tensor, H: int) -> torch.Tensor:
        u = usage(rows, H, self.k_pool, self.pad_mode)  # [..., H, T]
        return u.clamp_min(0).mean(-2) if self.ablation == "no_mass" else normalize_mass(u).mean(-2)

    def _used_mass(self, m_cur: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if self.ablation == "global_topk":
            return m_cur  # credit tracked, not used
        if self.ablation == "no_mass":
            return self.beta * m_cur + (1 - self.beta) * c
        return normalize_mass(self.beta * m_cur + (1 - self.beta) * normalize_mass(c))

    def _credit_of(self, req, device: torch.device) -> RowView:
        """The request's row of the policy's EMA credit table (every request's credit in one tensor)."""
        if req.state.credit is None:
            req.state.credit = self._credit.acquire(req.num_layers, device)
        return req.state.credit

    def select_layer(self, req, layer: int, pos: np.ndarray, buf: np.ndarray, rec: list, H: int) -> np.ndarray:
        """Keep indices into ``pos`` (ascending positions) for one layer at an event."""
        T = len(pos)
        keys, values = req.kv(layer, pos)
        w_eff, rows, rows_all = self.evidence(req, layer, pos, rec, keys, H)
        _, m_used = self.masses(req, layer, pos, rows, H)
        ev = Evidence(rows=rows_all, queries=rec, keys=keys, values=values)
        g = head_mean(self._scorer.score(req, layer, pos, req.state.memo, ev))
        g = g if isinstance(g, torch.Tensor) else torch.as_tensor(g)
        extra = np.nonzero(np.isin(pos, buf))[0]  # residual-buffer tokens cannot be evicted
        keep, _ = ams_select(m_used.cpu().numpy(), g.cpu().numpy(), self.budget, delta=self.delta,
                             l_min=self.l_min, l_max=self.l_max, q_min=self.q_min, n_sink=self.n_sink,
                             n_last=self.n_last, mode=self.mode, ablation=self.ablation, extra_must=extra)
        mu = m_used.cpu().numpy()
        req.state.window_mass.append(float(mu[T - w_eff:].sum() / max(mu.sum(), 1e-30)))
        return keep

    def _scale(self, keys: torch.Tensor) -> float:
        return self._sm_scale if self._sm_scale is not None else 1.0 / math.sqrt(keys.shape[-1])

    def extra_stats(self, req) -> dict:
        wm = req.state.window_mass
        return {"ams_events": req.state.events, "ams_noop_events": req.state.noops,
                "ams_window_mass_share": (sum(wm) / len(wm)) if wm else None,
                "cache_eviction": req.eviction_mode}
