"""AMS's selection (spec ams.md §2.5–2.7), pure functions over one layer's ``T`` slots in cache order
(ascending positions): must-keep slots, mass-based segments, per-segment quotas, in-segment top-k."""
from __future__ import annotations

import math

import numpy as np

FIXED_SEGMENT = 128


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


def _top_in_segments(segs, q, is_must: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``_top`` of each segment's non-must slots, ``q[i]`` of segment ``i``, in one sort (segment first)."""
    if not segs:
        return np.zeros(0, np.int64)
    starts = np.fromiter((a for a, _ in segs), np.int64, len(segs))
    ends = np.fromiter((b for _, b in segs), np.int64, len(segs))
    seg_of = np.repeat(np.arange(len(segs)), ends - starts)
    idx = np.arange(starts[0], ends[-1])[~is_must[starts[0]:ends[-1]]]
    seg = seg_of[idx - starts[0]]
    order = np.lexsort((-idx, -g[idx], seg))  # by segment, then score descending, then the higher index
    idx, seg = idx[order], seg[order]
    first = np.searchsorted(seg, np.arange(len(segs)))
    rank = np.arange(len(idx)) - first[seg]
    return idx[rank < np.asarray(q, np.int64)[seg]]


def select(segs, q, must: np.ndarray, g: np.ndarray, T_keep: int, mode: str = "reserve") -> np.ndarray:
    """Keep indices, sorted (spec §2.7)."""
    T = len(g)
    is_must = np.zeros(T, bool)
    is_must[must] = True
    if mode == "reserve":
        keep = np.union1d(must, _top_in_segments(segs, q, is_must, g))
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
