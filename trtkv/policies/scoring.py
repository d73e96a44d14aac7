"""Scoring helpers shared by the scorers and policies: per-position tables, head reductions, 1-D pooling,
cosine redundancy (R-KV), and top-k / bottom-k selection with deterministic ties.

Everything works in absolute token positions; nothing here touches pages or the cache.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


# --- per-position tables ----------------------------------------------------------------------
class PositionTable:
    """Dense values indexed by absolute token position, per layer: a ``[L, *inner, cap]`` tensor that grows
    on demand. ``init`` (optional) fills newly grown columns from their positions (e.g. creation steps)."""

    def __init__(self, num_layers: int, inner: tuple[int, ...] = (), fill: float = 0.0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", init=None):
        self.num_layers, self.inner, self.fill, self.dtype, self.init = num_layers, inner, fill, dtype, init
        self.data = torch.full((num_layers, *inner, 0), fill, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def ensure(self, max_pos: int) -> None:
        cap = self.data.shape[-1]
        if max_pos < cap:
            return
        new_cap = max(64, 2 * cap, max_pos + 1)
        grown = torch.full((self.num_layers, *self.inner, new_cap), self.fill, dtype=self.dtype, device=self.device)
        grown[..., :cap] = self.data
        if self.init is not None:
            pos = torch.arange(cap, new_cap, device=self.device)
            grown[..., cap:] = self.init(pos).to(self.dtype)
        self.data = grown

    def index(self, positions) -> torch.Tensor:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if len(pos):
            self.ensure(int(pos.max()))
        return torch.from_numpy(pos).to(self.device)

    def get(self, layer: int, positions) -> torch.Tensor:
        idx = self.index(positions)
        return self.data[layer].index_select(-1, idx)

    def add(self, layer: int, positions, values: torch.Tensor) -> None:
        """Add ``values [*inner, n]`` at distinct ``positions [n]``."""
        idx = self.index(positions)
        self.data[layer].index_add_(-1, idx, values.to(self.device, self.dtype))

    def add_layers(self, items: list[tuple[int, np.ndarray, torch.Tensor]]) -> None:
        """``add`` of several ``(layer, positions [n], values [*inner, n])`` in one scatter (a decode step's
        statistics of every layer, per request: one call instead of one per layer)."""
        if not self.inner and len(items) > 1:
            pos = [np.asarray(p, np.int64) for _, p, _ in items]
            lens = [len(p) for p in pos]
            flat = np.concatenate(pos)
            if len(flat):
                self.ensure(int(flat.max()))
                cap = self.data.shape[-1]
                flat += np.repeat(np.fromiter((layer * cap for layer, _, _ in items), np.int64, len(items)), lens)
                vals = torch.cat([v.to(self.dtype) for _, _, v in items])
                self.data.view(-1).index_add_(0, torch.from_numpy(flat).to(self.device), vals.to(self.device))
            return
        for layer, positions, values in items:
            self.add(layer, positions, values)

    def set(self, layer: int, positions, values) -> None:
        idx = self.index(positions)
        if isinstance(values, torch.Tensor):
            values = values.to(self.device, self.dtype)
        self.data[layer][..., idx] = values


def accumulate_attention(table, req, stats, phase: str):
    """Add each observed layer's attention, summed over query heads (and the prefill window's queries),
    to a ``[L, positions]`` table (a ``PositionTable`` created on first use, or a ``RowView``): H2O's
    accumulated attention, SnapKV's votes."""
    if not stats.layers:
        return table
    if table is None:
        table = PositionTable(req.num_layers, device=next(iter(stats.layers.values())).weights.device)
    table.add_layers([(layer, ls.positions, ls.weights.sum(dim=(0, 1)) if phase == "prefill" else head_sums(ls))
                      for layer, ls in stats.layers.items()])
    return table


def head_sums(ls) -> torch.Tensor:
    """A decode step's ``[n]`` weights summed over query heads: the statistics' own sums (``plugins/head_sums``,
    what the batch form carries too) where they came with them."""
    return ls.head_sums if ls.head_sums is not None else ls.weights.sum(0)


# --- attention reductions ---------------------------------------------------------------------
def group_mean(w: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[..., Hq, n]`` query-head rows -> ``[..., H, n]`` averaged over each KV head's query group."""
    *lead, hq, n = w.shape
    return w.reshape(*lead, num_kv_heads, hq // num_kv_heads, n).mean(-2)


def head_reduce(w: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """``[Hq, n]`` -> ``[n]``: mean (or max) over all query heads of a layer."""
    return w.amax(0) if how == "max" else w.mean(0)


def pool1d(x: torch.Tensor, kernel: int, mode: str = "avg") -> torch.Tensor:
    """Stride-1 pooling along the last dim, same length. ``avg``: zero padding, always divides by ``kernel``
    (SnapKV/AMS); ``max``: -inf padding (R-KV). Even kernels are padded on the right by one extra."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    lead, T = x.shape[:-1], x.shape[-1]
    left, right = (kernel - 1) // 2, kernel // 2
    if mode == "max":
        y = F.pad(x.reshape(-1, 1, T).float(), (left, right), value=-math.inf)
        return F.max_pool1d(y, kernel, stride=1).reshape(*lead, T).to(x.dtype)
    # the window's sum left to right, then / kernel: F.avg_pool1d's own arithmetic (the same bits, pinned by
    # tests/test_scoring_selection.py), as kernel shifted adds - ~5x faster than its CPU kernel at AMS's shapes
    y = F.pad(x.float(), (left, right), value=0.0)
    acc = y[..., :T].clone()
    for j in range(1, kernel):
        acc += y[..., j:j + T]
    return acc.div_(kernel).to(x.dtype)


def normalize_mass(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``N(x) = (relu(x) + eps) / sum(relu(x) + eps)`` along the last dim (AMS Eq. 1)."""
    y = x.clamp_min(0) + eps
    return y / y.sum(-1, keepdim=True)


# --- redundancy (R-KV) ------------------------------------------------------------------------
def cosine_redundancy(keys: torch.Tensor, threshold: float = 0.5, retain_ratio: float | None = None) -> torch.Tensor:
    """R-KV redundancy of keys ``[H, n, D]`` -> ``[H, n]`` (higher = more redundant).

    Cosine-similarity matrix with a zero diagonal; in each row, the most recent near-duplicates (similarity
    above ``threshold``) are exempted — one of them (``retain_ratio=None``, the KVPress rule) or
    ``max(1, floor(retain_ratio * count))`` of them (the R-KV release) — so the latest copy of a repeated
    pattern stays; then the row mean, softmax-normalised over tokens.
    """
    H, n, _ = keys.shape
    if n == 0:
        return keys.new_zeros(H, 0)
    kn = F.normalize(keys.float(), dim=-1)
    S = kn @ kn.transpose(-1, -2)
    S.diagonal(dim1=-2, dim2=-1).zero_()
    near = S > threshold
    count = near.sum(-1, keepdim=True)
    if retain_ratio is None:
        r = torch.ones_like(count)
    else:
        r = torch.clamp((count.float() * retain_ratio).floor().long(), min=1)
    from_right = near.flip(-1).cumsum(-1).flip(-1)  # near-duplicates at this column or later
    exempt = near & (from_right <= r)
    S = S.masked_fill(exempt, 0.0)
    return torch.softmax(S.mean(-1), dim=-1)


def rkv_z(importance: torch.Tensor, keys: torch.Tensor, mix_lambda: float, kernel: int, threshold: float,
          retain_ratio: float | None) -> torch.Tensor:
    """R-KV's score ``λ·maxpool(I) − (1−λ)·R`` per KV head: importance ``[H, n]``, keys ``[H, n, D]``."""
    imp = pool1d(importance.float(), kernel, "max")
    red = cosine_redundancy(keys, threshold, retain_ratio).to(imp.device)
    return mix_lambda * imp - (1.0 - mix_lambda) * red


# --- selection --------------------------------------------------------------------------------
def as_numpy(scores) -> np.ndarray:
    """Scores as a float numpy array (a tensor's values copied to the host)."""
    return scores.detach().float().cpu().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores, float)


def lowest(positions: np.ndarray, scores, k: int) -> np.ndarray:
    """The ``k`` positions with the lowest score; ties: the older position first (deterministic)."""
    if k <= 0 or len(positions) == 0:
        return positions[:0]
    s = as_numpy(scores)
    order = np.lexsort((positions, s))
    return positions[order[:k]]


def top_keep(positions: np.ndarray, scores, k: int) -> np.ndarray:
    """The ``k`` positions with the highest score; ties: the more recent position first."""
    if k <= 0 or len(positions) == 0:
        return positions[:0]
    s = as_numpy(scores)
    order = np.lexsort((-positions, -s))
    return np.sort(positions[order[:k]])


def sorted_member(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.isin(a, b)`` for ascending ``b`` (duplicates allowed): a binary search per element of ``a``,
    without ``isin``'s sort of both arrays (the per-(request, layer) eviction path calls this every step)."""
    if len(b) == 0 or len(a) == 0:
        return np.zeros(len(a), bool)
    i = np.searchsorted(b, a)
    np.minimum(i, len(b) - 1, out=i)
    return b[i] == a


DENSE_LOOKUP_SPAN = 64  # a dense table up to this many entries per given-or-asked position (plus 4096)


def lookup(positions: np.ndarray, values, default: float = 0.0):
    """``f(query_positions) -> np.ndarray`` reading ``values [n]`` (given at unique ``positions [n]``, any
    order); positions not given read ``default``. Token positions are small non-negative integers, so the
    usual case is a dense table indexed by position (a fill, a scatter and a gather: no sort; a scored
    policy asks once per request, layer and step); otherwise a sorted search."""
    vals = as_numpy(values)
    pos = np.asarray(positions, dtype=np.int64)

    def f(query) -> np.ndarray:
        query = np.asarray(query, dtype=np.int64)
        if len(pos) == 0:
            return np.full(len(query), default)
        lo, hi = min(pos.min(), query.min(initial=0)), max(pos.max(), query.max(initial=0))
        if lo >= 0 and hi < 4096 + DENSE_LOOKUP_SPAN * (len(pos) + len(query)):
            table = np.full(hi + 1, default, dtype=np.result_type(vals, default))
            table[pos] = vals
            return table[query]
        order = np.argsort(pos, kind="stable")
        sp, sv = pos[order], vals[order]
        i = np.clip(np.searchsorted(sp, query), 0, len(sp) - 1)
        return np.where(sp[i] == query, sv[i], default)

    return f


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_positive(**kwargs) -> None:
    for k, v in kwargs.items():
        if v is None or v < 1:
            raise ValueError(f"{k} must be a positive integer; got {v!r}")
