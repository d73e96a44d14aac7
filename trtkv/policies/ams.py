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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from trtkv.policies.base import KVPolicy, StatsRequest
from trtkv.policies.scoring import (PositionTable, check_choice, check_positive, group_mean, kv_all,
                                    normalize_mass, pool1d, rkv_z)

PRESETS = {
    "paper": dict(delta=0.1, l_min=16, l_max=256, q_min=1, lam=0.9, beta=0.9, window=128),
    "code": dict(delta=0.02, l_min=32, l_max=1024, q_min=8, lam=0.8, beta=0.7, window=32),
}
SCORERS = ("tova", "expected_attention", "keydiff", "rkv")
RKV_WINDOW, RKV_KERNEL, RKV_LAMBDA, RKV_THRESHOLD, EA_SINK_SLOTS = 8, 7, 0.07, 0.5, 4
FIXED_SEGMENT = 128


# --- selection (pure; cache order = ascending positions) -----------------------------------------------
def must_keep(T: int, T_keep: int, n_sink: int, n_last: int, mode: str = "reserve") -> np.ndarray:
    """Indices of the must-keep slots (spec §2.6): reserve shrinks the suffix first, reference the sinks."""
    if mode == "reserve":
        ns = min(n_sink, T_keep)
        nl = min(n_last, T_keep - ns)
    else:
        nl = min(n_last, T_keep)
        ns = min(n_sink, T_keep - nl)
    return np.union1d(np.arange(min(ns, T)), np.arange(max(T - nl, 0), T)).astype(np.int64)


def segment(mu: np.ndarray, delta: float, l_min: int, l_max: int) -> list[tuple[int, int]]:
    """Mass-based contiguous segments ``[a, b)`` of ``[0, T)`` (spec §2.5: cut, split at l_max, merge forward)."""
    T = len(mu)
    if T == 0:
        return []
    cum = np.cumsum(np.asarray(mu, dtype=np.float64))
    n_targets = math.ceil(1.0 / delta - 1e-9)
    targets = [k * delta for k in range(1, n_targets) if k * delta < 1.0 - 1e-12]
    cuts = np.searchsorted(cum, targets, side="left") if targets else np.zeros(0, np.int64)
    cuts = np.unique(np.clip(cuts, 1, T - 1)) if T > 1 else np.zeros(0, np.int64)
    bounds = [0, *[int(c) for c in cuts], T]
    segs = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    split = []
    for a, b in segs:
        while b - a > l_max:
            split.append((a, a + l_max))
            a += l_max
        split.append((a, b))
    merged, i = [], 0
    while i < len(split):
        a, b = split[i]
        i += 1
        while b - a < l_min and i < len(split):
            b = split[i][1]
            i += 1
        merged.append((a, b))
    return merged


def fixed_segments(T: int, length: int = FIXED_SEGMENT) -> list[tuple[int, int]]:
    return [(a, min(a + length, T)) for a in range(0, T, length)]


def _round_robin(q: list[int], lo: list[int], hi: list[int], total: int) -> list[int]:
    """The release's "lightweight adjustment": ±1 per segment in order until ``sum(q) == total``."""
    while sum(q) > total:
        changed = False
        for i in range(len(q)):
            if q[i] > lo[i]:
                q[i] -= 1
                changed = True
                if sum(q) == total:
                    break
        if not changed:
            break
    while sum(q) < total:
        changed = False
        for i in range(len(q)):
            if q[i] < hi[i]:
                q[i] += 1
                changed = True
                if sum(q) == total:
                    break
        if not changed:
            break
    return q


def allocate(segs: list[tuple[int, int]], mu: np.ndarray, T_keep: int, must: np.ndarray, q_min: int,
             mode: str = "reserve") -> list[int]:
    """Per-segment quotas (spec §2.6)."""
    T = len(mu)
    is_must = np.zeros(T, bool)
    is_must[must] = True
    L = [b - a for a, b in segs]
    M = [float(mu[a:b].sum()) for a, b in segs]
    if mode == "reserve":
        C = [L[i] - int(is_must[a:b].sum()) for i, (a, b) in enumerate(segs)]
        budget = T_keep - len(must)
    else:
        C = list(L)
        budget = T_keep
    q = [min(q_min, c) for c in C]
    if mode == "reserve" and sum(q) > budget:  # cannot happen with the paper's defaults
        out, left = [0] * len(segs), budget
        for i in sorted(range(len(segs)), key=lambda i: (-M[i], i)):
            out[i] = min(q[i], left)
            left -= out[i]
        return out
    if mode != "reserve" and sum(q) >= budget:  # the release shrinks every quota > 1, guarded
        q = _round_robin(q, [min(1, x) for x in q], C, budget) if sum(q) > budget else q
    floor = list(q)
    rest = budget - sum(q)
    total_m = sum(M)
    if rest > 0 and total_m > 0:
        q = [min(C[i], q[i] + int(np.rint(rest * M[i] / total_m))) for i in range(len(segs))]
    return _round_robin(q, floor, C, budget)


def _top(idx: np.ndarray, g: np.ndarray, k: int) -> np.ndarray:
    """Top-k of ``idx`` by ``g`` (desc), ties: the higher index."""
    if k <= 0 or len(idx) == 0:
        return idx[:0]
    order = np.lexsort((-idx, -g[idx]))
    return idx[order[:k]]


def select(segs, q, must: np.ndarray, g: np.ndarray, T_keep: int, mode: str = "reserve") -> np.ndarray:
    """Keep indices, sorted (spec §2.7)."""
    T = len(g)
    is_must = np.zeros(T, bool)
    is_must[must] = True
    if mode == "reserve":
        picks = [_top(np.arange(a, b)[~is_must[a:b]], g, qi) for (a, b), qi in zip(segs, q)]
        keep = np.union1d(must, np.concatenate(picks) if picks else must[:0])
        if len(keep) < T_keep:  # backfill: only if the capacities ran out
            rest = np.setdiff1d(np.arange(T), keep)
            keep = np.union1d(keep, _top(rest, g, T_keep - len(keep)))
        return keep.astype(np.int64)
    cand = np.concatenate([_top(np.arange(a, b), g, qi) for (a, b), qi in zip(segs, q)]) if segs else must[:0]
    cand = np.setdiff1d(cand, must)
    need = T_keep - len(must)
    cand = _top(cand, g, len(cand))
    if len(cand) < need:
        rest = np.setdiff1d(np.setdiff1d(np.arange(T), must), cand)
        cand = np.concatenate([cand, _top(rest, g, need - len(cand))])
    return np.union1d(must, cand[:need]).astype(np.int64)


def ams_select(mu: np.ndarray, g: np.ndarray, T_keep: int, *, delta: float, l_min: int, l_max: int, q_min: int,
               n_sink: int, n_last: int, mode: str = "reserve", ablation: str = "none",
               extra_must: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """One AMS selection over ``T`` slots: keep indices (sorted, exactly ``T_keep`` when ``T > T_keep``) and
    the segments/quotas used. ``mu`` is the mass (normalised inside), ``g`` the scorer's scores."""
    mu = np.asarray(mu, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    T = len(mu)
    if T <= T_keep:
        return np.arange(T), {"segments": [(0, T)], "quotas": [T]}
    must = must_keep(T, T_keep, n_sink, n_last, mode)
    if extra_must is not None and len(extra_must):
        must = np.union1d(must, extra_must).astype(np.int64)
    s = mu.clip(min=0).sum()
    mu = mu / s if s > 0 else np.full(T, 1.0 / T)
    if ablation == "global_topk":
        segs = [(0, T)]
        q = [T_keep - len(must)] if mode == "reserve" else [T_keep]
    else:
        segs = fixed_segments(T) if ablation == "fixed_segments" else segment(mu, delta, l_min, l_max)
        q = allocate(segs, mu, T_keep, must, q_min, mode)
    keep = select(segs, q, must, g, T_keep, mode)
    return keep, {"segments": segs, "quotas": q, "must": must}


# --- evidence and scorers ----------------------------------------------------------------------------
def window_rows(queries: torch.Tensor, q_pos: np.ndarray, keys: torch.Tensor, pos: np.ndarray,
                sm_scale: float) -> torch.Tensor:
    """Softmax rows ``[w, Hq, T]`` of queries ``[w, Hq, D]`` over keys ``[T, H, D]`` with the causal mask
    ``pos[j] <= q_pos[w]`` (what the decode kernel computed at those steps when nothing was evicted since)."""
    w, Hq, D = queries.shape
    H = keys.shape[1]
    qf = queries.float().view(w, H, Hq // H, D)
    logits = torch.einsum("whgd,thd->whgt", qf, keys.float().to(qf.device)) * sm_scale
    pos_t = torch.as_tensor(pos, device=qf.device)
    qp = torch.as_tensor(np.asarray(q_pos), device=qf.device)
    masked = pos_t[None, :] > qp[:, None]  # [w, T]
    logits = logits.masked_fill(masked[:, None, None, :], -math.inf)
    return torch.softmax(logits, -1).reshape(w, Hq, -1)


def usage(rows: torch.Tensor, num_kv_heads: int, k_pool: int, pad_mode: str = "max") -> torch.Tensor:
    """Usage evidence ``u [H, T]`` from the window's rows ``[W, Hq, T]`` (spec §2.3 steps 4–7)."""
    W, Hq, T = rows.shape
    a = rows.float().mean(0)  # [Hq, T]
    nw = T - W
    u_nw = group_mean(pool1d(a[:, :nw], k_pool, "avg"), num_kv_heads)  # [H, T - W]
    if pad_mode == "max":
        pad = float(u_nw.max()) if nw > 0 else 1.0
    elif pad_mode == "mean":
        pad = float(u_nw.mean()) if nw > 0 else 1.0
    else:
        pad = 0.0
    return torch.cat([u_nw, u_nw.new_full((num_kv_heads, W), pad)], dim=1)


def tova_scores(last_row: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[Hq, T]`` current-query attention -> ``[H, T]`` (the same vector per KV head; the last slot gets max)."""
    g = last_row.float().mean(0)
    if g.numel() > 1:
        g[-1] = g[:-1].max()
    return g[None].expand(num_kv_heads, -1).clone()


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff: ``−cos(k, anchor)`` per KV head, anchor = mean unit key. ``keys [T, H, D]`` -> ``[H, T]``."""
    kn = torch.nn.functional.normalize(keys.float(), dim=-1)
    anchor = kn.mean(0)  # [H, D]
    return -torch.nn.functional.cosine_similarity(kn, anchor[None], dim=-1).T


def rkv_scores(rows: torch.Tensor, keys: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """AMS's R-KV scorer (KVPress ``RKVPress``): rows ``[w, Hq, T]`` of the last w queries, keys ``[T, H, D]``."""
    w, Hq, T = rows.shape
    if T <= RKV_WINDOW:
        return torch.ones(num_kv_heads, T, device=rows.device)
    n = T - w
    hist = rows[:, :, :n].float()
    hist = hist / hist.sum(-1, keepdim=True).clamp_min(1e-30)  # softmax over the historical slots only
    imp = group_mean(hist.mean(0), num_kv_heads)  # [H, n]
    z = rkv_z(imp, keys[:n].float().transpose(0, 1).to(imp.device), RKV_LAMBDA, RKV_KERNEL, RKV_THRESHOLD, None)
    g = torch.empty(num_kv_heads, T, device=imp.device)
    g[:, :n] = z
    top = z.max() + 10.0
    g[:, n:] = top
    g[:, : min(4, T)] = top
    return g


def rope_average(inv_freq: torch.Tensor, p0: int, n_future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cos/sin ``[D]`` (half-split layout) of RoPE over positions ``p0 .. p0+n_future-1``."""
    p = torch.arange(p0, p0 + n_future, dtype=torch.float64, device=inv_freq.device)
    ang = p[:, None] * inv_freq.double()[None, :]
    c, s = ang.cos().mean(0), ang.sin().mean(0)
    return torch.cat([c, c]).float(), torch.cat([s, s]).float()


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``R`` with ``R x = x*cos + rotate_half(x)*sin`` for ``[D]`` cos/sin."""
    D = cos.numel()
    h = D // 2
    rh = torch.zeros(D, D, device=cos.device)
    rh[:h, h:] = -torch.eye(h, device=cos.device)
    rh[h:, :h] = torch.eye(h, device=cos.device)
    return torch.diag(cos) + torch.diag(sin) @ rh


def ea_log_expectation(mu: torch.Tensor, cov: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``log E[exp(q·k/√d)]`` for Gaussian ``q ~ N(mu [A, D], cov [A, D, D])`` and keys ``[T, A, D]`` -> ``[A, T]``:
    ``mu·k/√d + kᵀ cov k / (2d)``."""
    D = mu.shape[-1]
    return (torch.einsum("ad,tad->at", mu, keys) / math.sqrt(D)
            + torch.einsum("tad,ade,tae->at", keys, cov, keys) / (2 * D))


def expected_attention_scores(q_pre: torch.Tensor, inv_freq: torch.Tensor, p0: int, n_future: int,
                              keys: torch.Tensor, values: torch.Tensor, epsilon: float = 0.01,
                              sink_slots: int = EA_SINK_SLOTS) -> torch.Tensor:
    """Expected Attention (spec §2.10): pre-RoPE queries ``[n, Hq, D]`` -> scores ``[H, T]`` for post-RoPE keys
    and values ``[T, H, D]``. Slots ``< sink_slots`` get the maximum."""
    n, Hq, D = q_pre.shape
    T, H, _ = keys.shape
    q = q_pre.double()
    mu = q.mean(0)  # [Hq, D]
    qc = q - mu
    cov = torch.einsum("nad,nae->ade", qc, qc) / max(n, 1)  # population covariance
    cos, sin = rope_average(inv_freq, p0, n_future)
    R = rope_matrix(cos, sin).double().to(q.device)
    mu_r = mu @ R.T
    cov_r = R @ cov @ R.T
    k = keys.double().to(q.device)
    G = Hq // H
    kq = k.repeat_interleave(G, dim=1)  # [T, Hq, D]
    z = ea_log_expectation(mu_r, cov_r, kq)
    s = min(sink_slots, T)
    p = torch.zeros_like(z)
    if T > s:
        p[:, s:] = torch.softmax(z[:, s:], -1)
    g = (p.view(H, G, T).mean(1) + epsilon) * values.double().to(q.device).norm(dim=-1).T
    if s:
        g[:, :s] = g.max()
    return g.float()


# --- the policy ------------------------------------------------------------------------------------
@dataclass
class AMSPolicy(KVPolicy):
    name = "ams"
    description = "mass-segmented quotas + in-segment top-k of a plug-in scorer, gather-and-compact (Yang & Shen 2026)"
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
        if self.scorer == "expected":
            self.scorer = "expected_attention"
        check_choice("scorer", self.scorer, SCORERS)
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
        self._inv_freq: torch.Tensor | None = None
        self._sm_scale: float | None = None

    # --- engine integration ------------------------------------------------------------------
    def bind_model(self, arch) -> None:
        from trtkv.models.rope import inverse_frequencies

        self._inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)[0]
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
        return min(self.n_buf, max(self.window, RKV_WINDOW if self.scorer == "rkv" else 1))

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase == "decode" and (-(req.step + 1)) % self.interval < max(self.n_record, 1):
            return StatsRequest(queries=True)
        return None

    def on_request_init(self, req) -> None:
        req.state.update(queries=[[] for _ in range(req.num_layers)], credit=None, events=0, noops=0,
                         window_mass=[])

    def on_decode_step_end(self, req, stats) -> None:
        t = req.step
        qs = req.state["queries"]
        for layer, ls in stats.layers.items():
            if ls.query is not None:
                qs[layer].append((req.position - 1, ls.query))  # the token this step wrote
        if t % self.interval:
            return
        self._event(req)
        req.state["queries"] = [[] for _ in range(req.num_layers)]

    # --- one event ----------------------------------------------------------------------------
    def _event(self, req) -> None:
        H = req.cache.cfg.num_kv_heads
        acted = False
        for layer in range(req.num_layers):
            paged = req.live_positions(layer)
            buf = np.asarray(req.buffered_positions(layer), dtype=np.int64)
            pos = np.sort(np.concatenate([paged, buf]))
            T = len(pos)
            if T <= self.budget:
                continue  # no-op: KV and credit unchanged (spec §2.1)
            keep = self.select_layer(req, layer, pos, buf, req.state["queries"][layer], H)
            req.evict(layer, np.setdiff1d(paged, pos[keep]))
            acted = True
        req.state["events" if acted else "noops"] += 1

    def evidence(self, req, layer: int, pos: np.ndarray, rec: list, keys: torch.Tensor, H: int):
        """(w_eff, window rows ``[w_eff, Hq, T]``, rows of the last max(w_eff, 8) queries) for one layer."""
        T = len(pos)
        w_eff = max(1, min(self.window, self.n_buf - 1, T - 1, self.budget))
        if not rec:  # hs = 0 and nothing recorded: uniform evidence
            rows = torch.full((1, H, T), 1.0 / T, device=keys.device)
            return w_eff, rows, rows
        last = rec[-max(w_eff, RKV_WINDOW):]  # recorded queries, the current step's last
        q_pos = np.array([p for p, _ in last])
        rows_all = window_rows(torch.stack([q for _, q in last]), q_pos, keys, pos, self._scale(keys))
        return w_eff, rows_all[-w_eff:], rows_all

    def masses(self, req, layer: int, pos: np.ndarray, rows: torch.Tensor, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(m_cur, m_used) ``[T]`` of one layer; updates the layer's EMA credit (spec §2.3–2.4)."""
        u = usage(rows, H, self.k_pool, self.pad_mode)  # [H, T]
        m_cur = u.clamp_min(0).mean(0) if self.ablation == "no_mass" else normalize_mass(u).mean(0)
        if not self.use_credit or self.ablation == "no_credit":
            return m_cur, m_cur
        credit = req.state.get("credit")
        if credit is None:
            credit = req.state["credit"] = PositionTable(req.num_layers, device=m_cur.device)
        c = self.lam * credit.get(layer, pos) + (1 - self.lam) * m_cur  # new slots read 0 (zero-extended)
        credit.set(layer, pos, c)
        if self.ablation == "global_topk":
            return m_cur, m_cur  # credit tracked, not used
        if self.ablation == "no_mass":
            return m_cur, self.beta * m_cur + (1 - self.beta) * c
        return m_cur, normalize_mass(self.beta * m_cur + (1 - self.beta) * normalize_mass(c))

    def select_layer(self, req, layer: int, pos: np.ndarray, buf: np.ndarray, rec: list, H: int) -> np.ndarray:
        """Keep indices into ``pos`` (ascending positions) for one layer at an event."""
        T = len(pos)
        keys, values = kv_all(req, layer, pos)
        w_eff, rows, rows_all = self.evidence(req, layer, pos, rec, keys, H)
        _, m_used = self.masses(req, layer, pos, rows, H)
        g = self._scores(req, pos, keys, values, rows_all, rec, H).mean(0)
        extra = np.nonzero(np.isin(pos, buf))[0]  # residual-buffer tokens cannot be evicted
        keep, _ = ams_select(m_used.cpu().numpy(), g.cpu().numpy(), self.budget, delta=self.delta,
                             l_min=self.l_min, l_max=self.l_max, q_min=self.q_min, n_sink=self.n_sink,
                             n_last=self.n_last, mode=self.mode, ablation=self.ablation, extra_must=extra)
        mu = m_used.cpu().numpy()
        req.state["window_mass"].append(float(mu[T - w_eff:].sum() / max(mu.sum(), 1e-30)))
        return keep

    def _scale(self, keys: torch.Tensor) -> float:
        return self._sm_scale if self._sm_scale is not None else 1.0 / math.sqrt(keys.shape[-1])

    def _scores(self, req, pos, keys, values, rows_all, rec, H) -> torch.Tensor:
        if self.scorer == "tova":
            return tova_scores(rows_all[-1], H)
        if self.scorer == "keydiff":
            return keydiff_scores(keys)
        if self.scorer == "rkv":
            return rkv_scores(rows_all[-min(RKV_WINDOW, len(rows_all)):], keys, H)
        if self._inv_freq is None:
            raise RuntimeError("ams scorer=expected_attention needs the model's RoPE (engine calls bind_model)")
        rec = rec[-self.n_buf:] if self.n_buf else rec[-1:]
        entries = rec[self.ea_drop:] if len(rec) > self.ea_drop else rec
        q_pos = torch.tensor([p for p, _ in entries])
        q = torch.stack([x for _, x in entries]).float()  # [n, Hq, D] post-RoPE
        q_pre = unrotate(q, q_pos, self._inv_freq.to(q.device))
        return expected_attention_scores(q_pre, self._inv_freq.to(q.device), req.position, self.ea_n_future,
                                         keys, values, self.ea_epsilon)

    def extra_stats(self, req) -> dict:
        wm = req.state.get("window_mass") or []
        return {"ams_events": req.state.get("events", 0), "ams_noop_events": req.state.get("noops", 0),
                "ams_window_mass_share": (sum(wm) / len(wm)) if wm else None,
                "cache_eviction": req.cache.cfg.eviction}

    def on_request_finish(self, req) -> None:
        req.state.clear()


def unrotate(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: post-RoPE ``q [n, Hq, D]`` at ``positions [n]`` -> pre-RoPE (default/linear/llama3 scaling)."""
    from trtkv.models.rope import apply_rotary

    ang = positions.to(q.device, torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return apply_rotary(q, emb.cos(), -emb.sin())
