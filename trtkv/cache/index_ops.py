"""Per-index updates of 1-D state arrays where an index may repeat: ``np.add.at`` and its kin, without their cost;
and ``split_counts``, ``np.split`` by piece lengths without its cost.

``np.<ufunc>.at`` takes ~50 ns an element; an eviction event of a batch marks thousands of slots. Here the updates
are grouped by index once (a sort) and each index is updated once with its group's sum, OR or maximum: the same
result (integer sums, bit ORs and maxima do not depend on the order), a few vector passes. Short lists keep
``.at`` (cheaper than a sort).
"""
from __future__ import annotations

import numpy as np

AT_MAX = 64  # indices up to which ``ufunc.at`` is cheaper than grouping


def _groups(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, unique indices, group starts in the sorted order)``."""
    order = np.argsort(idx, kind="stable")
    s = idx[order]
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    return order, s[starts], starts


def add_at(a: np.ndarray, idx: np.ndarray, v) -> None:
    """``np.add.at(a, idx, v)`` (``v`` a scalar or one value an index; integer ``a``)."""
    idx = np.asarray(idx)
    if len(idx) <= AT_MAX:
        np.add.at(a, idx, v)
        return
    if np.ndim(v) == 0:
        u, counts = np.unique(idx, return_counts=True)
        a[u] += counts * v
        return
    order, u, starts = _groups(idx)
    a[u] += np.add.reduceat(np.asarray(v)[order], starts)


def or_at(a: np.ndarray, idx: np.ndarray, bits: np.ndarray) -> None:
    """``np.bitwise_or.at(a, idx, bits)``."""
    if len(idx) <= AT_MAX:
        np.bitwise_or.at(a, idx, bits)
        return
    order, u, starts = _groups(np.asarray(idx))
    a[u] |= np.bitwise_or.reduceat(bits[order], starts)


def clear_at(a: np.ndarray, idx: np.ndarray, bits: np.ndarray) -> None:
    """``np.bitwise_and.at(a, idx, ~bits)``: each index loses its bits."""
    if len(idx) <= AT_MAX:
        np.bitwise_and.at(a, idx, ~bits)
        return
    order, u, starts = _groups(np.asarray(idx))
    a[u] &= ~np.bitwise_or.reduceat(bits[order], starts)


def max_at(a: np.ndarray, idx: np.ndarray, v: np.ndarray) -> None:
    """``np.maximum.at(a, idx, v)``."""
    if len(idx) <= AT_MAX:
        np.maximum.at(a, idx, v)
        return
    order, u, starts = _groups(np.asarray(idx))
    a[u] = np.maximum(a[u], np.maximum.reduceat(v[order], starts))


def split_counts(a: np.ndarray, counts) -> list[np.ndarray]:
    """``a`` cut into consecutive pieces of ``counts[i]`` elements (views), as ``np.split(a, cumsum(counts)[:-1])``
    without its per-piece cost (microseconds a piece: an event splits thousands)."""
    ends = np.cumsum(counts).tolist()
    return [a[lo:hi] for lo, hi in zip([0, *ends], ends)]
