"""AMS's selection for many requests at once: ``ams_select`` (``ams_selection.py``, the reference) of every row
of ``mu, g [k, T]`` by array operations over the batch, as a keep mask.

An event selects in every layer for every request; one ``ams_select`` costs ~100 µs of small array operations,
so at 32 layers × 256 requests an event spent about a second there. Here the segments of all rows are one flat
list (cuts, ``l_max`` splits and the forward ``l_min`` merge advance every row together, one round per segment),
the quotas' ±1 adjustment is solved in closed form per row (how many full passes, then the first segments of the
last one), and the in-segment top-k of every segment of every row is one sort (of packed integer keys when the
scores are float32 values, as the scorers' are; else a stable float sort, then the keys). The segments, quotas
and keep sets equal the reference's (tests/test_ams.py draws rows against it); rows the closed forms do not cover
(a negative mass, a reserve that outgrows the budget, a backfill) go through the reference.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from trtkv.policies.ams_selection import FIXED_SEGMENT, ams_select, must_keep


def ams_keep_rows(mu: np.ndarray, g: np.ndarray, T_keep: int, *, delta: float, l_min: int, l_max: int,
                  q_min: int, n_sink: int, n_last: int, mode: str = "reserve", ablation: str = "none") -> np.ndarray:
    """Which slots ``ams_select(mu[j], g[j], T_keep, ...)`` keeps, for every row ``j`` of ``mu, g [k, T]``: a
    ``[k, T]`` mask."""
    mu = np.asarray(mu, np.float64)
    g = np.asarray(g)
    g32 = g if g.dtype == np.float32 else None  # (scores that are float32 values sort in one pass: _ranked_keys)
    g = np.asarray(g, np.float64)
    if g32 is None:
        with np.errstate(over="ignore"):  # (a value past float32's range: not one of them)
            as32 = g.astype(np.float32)
        g32 = as32 if np.array_equal(as32.astype(np.float64), g, equal_nan=True) else None
    k, T = mu.shape
    cfg = dict(delta=delta, l_min=l_min, l_max=l_max, q_min=q_min, n_sink=n_sink, n_last=n_last, mode=mode,
               ablation=ablation)
    keep = np.zeros((k, T), bool)
    if T <= T_keep:
        keep[:] = True
        return keep
    if mode != "reserve" or ablation == "global_topk":
        for j in range(k):
            keep[j, ams_select(mu[j], g[j], T_keep, **cfg)[0]] = True
        return keep
    must = must_keep(T, T_keep, n_sink, n_last, mode)
    plain = np.isfinite(mu).all(1) & (mu >= 0).all(1)  # (else the cumulative mass is not sorted: the reference)
    raw = mu  # (the reference's rows below take the masses as given: a NaN row is not normalised to uniform)
    s = mu.clip(min=0).sum(1, keepdims=True)
    mu = np.where(s > 0, mu / np.where(s > 0, s, 1.0), 1.0 / T)
    if ablation == "fixed_segments":
        starts = np.arange(0, T, FIXED_SEGMENT)
        seg_row, seg_a = np.repeat(np.arange(k), len(starts)), np.tile(starts, k)
        seg_b = np.tile(np.minimum(starts + FIXED_SEGMENT, T), k)
    else:
        seg_row, seg_a, seg_b = _segments(mu, delta, l_min, l_max)
    is_must = np.zeros(T, bool)
    is_must[must] = True
    q, fine = _quotas(mu, seg_row, seg_a, seg_b, is_must, T_keep - len(must), q_min)
    rows, idx = _top_in_segments(g, seg_row, seg_a, seg_b, q, is_must, g32)
    keep[:, must] = True
    keep[rows, idx] = True
    # a reserve past the budget, or a backfill (the capacities ran out): the reference's rules
    for j in np.flatnonzero(~(fine & plain) | (keep.sum(1) < T_keep)).tolist():
        keep[j] = False
        keep[j, ams_select(raw[j], g[j], T_keep, **cfg)[0]] = True
    return keep


def _segments(mu: np.ndarray, delta: float, l_min: int, l_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``segment`` of every row: ``(row, a, b)`` of each segment, rows in order, each row's segments in order."""
    k, T = mu.shape
    cum = np.cumsum(mu, axis=1)
    n_targets = math.ceil(1.0 / delta - 1e-9)
    targets = np.asarray([i * delta for i in range(1, n_targets) if i * delta < 1.0 - 1e-12], np.float64)
    if len(targets) and T > 1:
        cuts = np.clip(_searchsorted_rows(cum, targets), 1, T - 1)
        cuts = np.sort(cuts, axis=1)
        fresh = np.ones(cuts.shape, bool)
        fresh[:, 1:] = cuts[:, 1:] != cuts[:, :-1]  # (unique per row)
        bounds_row = np.concatenate([np.arange(k), np.nonzero(fresh)[0], np.arange(k)])
        bounds_at = np.concatenate([np.zeros(k, np.int64), cuts[fresh], np.full(k, T)])
        order = np.lexsort((bounds_at, bounds_row))
        bounds_row, bounds_at = bounds_row[order], bounds_at[order]
        last = np.r_[bounds_row[1:] != bounds_row[:-1], True]  # a row's final bound starts no segment
        row, a = bounds_row[~last], bounds_at[~last]
        b = bounds_at[np.flatnonzero(~last) + 1]
    else:
        row, a, b = np.arange(k), np.zeros(k, np.int64), np.full(k, T)
    # split at l_max: pieces of l_max, the last one the remainder
    n = -(-(b - a) // l_max)
    rank = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    row, pa = np.repeat(row, n), np.repeat(a, n) + rank * l_max
    pb = np.minimum(pa + l_max, np.repeat(b, n))
    # merge forward: a segment starting at piece s ends at its row's first piece e >= s with b_e - a_s >= l_min
    # (or the row's last piece); rows advance together, one segment a round
    stride = T + l_min + 2
    key_b = pb + row * stride  # every row's piece ends, increasing
    first = np.searchsorted(row, np.arange(k))
    last_piece = np.r_[first[1:], len(row)] - 1
    ptr, live = first.copy(), np.arange(k)
    out_row, out_a, out_b = [], [], []
    while len(live):
        s = ptr[live]
        e = np.minimum(np.searchsorted(key_b, pa[s] + l_min + live * stride, "left"), last_piece[live])
        out_row.append(live)
        out_a.append(pa[s])
        out_b.append(pb[e])
        ptr[live] = e + 1
        live = live[e + 1 <= last_piece[live]]
    row, a, b = (np.concatenate(x) for x in (out_row, out_a, out_b))
    order = np.lexsort((a, row))
    return row[order], a[order], b[order]


def _searchsorted_rows(cum: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``searchsorted(cum[j], targets, "left")`` of every (nondecreasing) row ``j``: one bisection for all rows."""
    k, T = cum.shape
    lo, hi = np.zeros((k, len(targets)), np.int64), np.full((k, len(targets)), T)
    rows = np.arange(k)[:, None]
    while (lo < hi).any():
        mid = (lo + hi) // 2
        below = cum[rows, np.minimum(mid, T - 1)] < targets
        lo, hi = np.where(below & (lo < hi), mid + 1, lo), np.where(below | (lo >= hi), hi, mid)
    return lo


def _quotas(mu: np.ndarray, row: np.ndarray, a: np.ndarray, b: np.ndarray, is_must: np.ndarray, budget: int,
            q_min: int) -> tuple[np.ndarray, np.ndarray]:
    """``allocate`` (reserve mode) of every segment: ``(quotas, fine [k])``; a row is not fine when its floors
    outgrow the budget (the reference's other rule)."""
    k = mu.shape[0]
    must_cum = np.r_[0, np.cumsum(is_must)]
    C = (b - a) - (must_cum[b] - must_cum[a])
    M = np.add.reduceat(mu.reshape(-1), a + row * mu.shape[1]) if len(a) else np.zeros(0)
    floor = np.minimum(q_min, C)
    floor_sum = np.bincount(row, floor, minlength=k)
    fine = floor_sum <= budget
    rest = (budget - floor_sum)[row]
    total_m = np.bincount(row, M, minlength=k)[row]
    grow = (rest > 0) & (total_m > 0)
    q = floor.copy()
    q[grow] = np.minimum(C[grow], floor[grow] + np.rint(rest[grow] * M[grow] / total_m[grow]).astype(np.int64))
    excess = np.bincount(row, q, minlength=k) - budget
    down = excess[row] > 0
    q = np.where(down, q - _passes(row, q - floor, np.maximum(excess, 0), down),
                 q + _passes(row, C - q, np.maximum(-excess, 0), ~down))
    return q, fine


def _passes(row: np.ndarray, room: np.ndarray, need: np.ndarray, on: np.ndarray) -> np.ndarray:
    """The ±1 round robin in closed form: passes over each row's segments (``on``), in order, each taking one unit
    from every segment with ``room`` left, until the row's ``need`` units are taken (or no room is left). Returns
    each segment's units taken."""
    room = np.where(on, room, 0)
    k = len(need)
    if not room.any():
        return room
    # the full passes P of each row: the largest P with sum(min(room, P)) <= need (bisection over all rows)
    lo, hi = np.zeros(k, np.int64), np.full(k, int(room.max()) + 1)
    while (hi - lo > 1).any():
        mid = (lo + hi) // 2
        fits = np.bincount(row, np.minimum(room, mid[row]), minlength=k) <= need
        lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid)
    taken = np.minimum(room, lo[row])
    left = need - np.bincount(row, taken, minlength=k).astype(np.int64)  # < the segments with room past P
    more = room > lo[row]
    rank = np.cumsum(more) - np.r_[0, np.cumsum(more)][np.searchsorted(row, row)]  # 1-based within the row
    return taken + (more & (rank <= left[row]))


def _top_in_segments(g: np.ndarray, row: np.ndarray, a: np.ndarray, b: np.ndarray, q: np.ndarray,
                     is_must: np.ndarray, g32: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each segment's ``q`` best non-must slots (score descending, ties to the higher index): ``(rows, slots)``.
    Every row's slots are ordered segment by segment, best first (``_ranked_keys``, or ``_ranked_two_sorts`` when
    the scores are not all float32 values), and each segment's first ``q`` taken. ``g32``: ``g`` as float32, when it
    holds the same values."""
    k, T = g.shape
    first = np.searchsorted(row, np.arange(k))
    local = np.arange(len(a)) - first[row]  # each segment's number within its row
    S = int(local.max()) + 1
    seg_of = np.repeat(local, b - a).reshape(k, T)  # (each row's segments partition [0, T) in order)
    seg_of[:, is_must] = S  # must slots sort past every segment
    ranked = None if g32 is None else _ranked_keys(g32, seg_of, S)
    seg, slots = ranked if ranked is not None else _ranked_two_sorts(g, seg_of)
    cell = (seg_of + (S + 1) * np.arange(k)[:, None]).reshape(-1)
    size = np.bincount(cell, minlength=k * (S + 1))  # non-must slots of each (row, segment)
    quota = np.zeros(k * (S + 1), np.int64)
    quota[row * (S + 1) + local] = q
    # the j-th slot of a row's order is chosen when it is among its segment's first q: j < start + q
    end = (np.cumsum(size.reshape(k, S + 1), axis=1) - size.reshape(k, S + 1)).reshape(-1) + quota
    chosen = np.arange(T) < end[seg + (S + 1) * np.arange(k)[:, None]]
    return np.nonzero(chosen)[0], slots[chosen]


def _ranked_two_sorts(g: np.ndarray, seg_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row's slots by segment, then score descending, then the higher index: ``(segments, slots) [k, T]``.
    A stable sort of each reversed row by score, then one sort of packed integer keys (segment, place in it)."""
    k, T = g.shape
    by_score = T - 1 - torch.sort(torch.from_numpy(-g[:, ::-1].copy()), dim=1, stable=True).indices.numpy()
    key = np.sort(np.take_along_axis(seg_of, by_score, 1) * T + np.arange(T), axis=1)
    return key // T, np.take_along_axis(by_score, key % T, 1)


def _ranked_keys(g32: np.ndarray, seg_of: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``_ranked_two_sorts`` in one sort, for float32 scores: each slot's key packs its segment, its score's bits
    mapped to an unsigned order (descending; -0 is +0, NaN after every number, as the sorts take them) and its
    index counted from the end, so one integer sort a row gives the order. None when the key needs 63 bits."""
    k, T = g32.shape
    t_bits, s_bits = max(1, (T - 1).bit_length()), S.bit_length()
    if t_bits + 32 + s_bits > 63:
        return None
    # (in place where it can: fresh [k, T] temporaries cost their first touch)
    down = (g32 + np.float32(0.0)).view(np.uint32)  # (+0.0: -0 becomes +0)
    flip = down >> 31
    np.negative(flip, out=flip)  # all ones for a negative score, else 0
    flip |= np.uint32(1 << 31)
    down ^= flip  # ascending with the score
    np.invert(down, out=down)  # descending
    down[np.isnan(g32)] = np.uint32((1 << 32) - 1)
    key = seg_of.astype(np.int64)
    key <<= 32
    key |= down
    key <<= t_bits
    key |= T - 1 - np.arange(T)
    key.sort(axis=1)
    slots = key & ((1 << t_bits) - 1)
    np.subtract(T - 1, slots, out=slots)
    key >>= 32 + t_bits
    return key, slots
