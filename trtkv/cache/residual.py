"""Residual buffers of all requests as rows of one shared arena.

A quantizing policy holds each request's last ``g`` tokens per layer in full precision until they flush as
one group. Each request's buffer (``ResidualBuffer``: ``k, v [L, g, H, D]`` and the positions it holds per
layer) is one row of a shared ``[rows, L, g, H, D]`` pair, so a decode step appends the whole batch's new K/V
in one indexed write per layer and attention reads the batch's buffers in one gather, instead of one small
copy per request.

The arena has ``max_batch`` rows from the start (the KV budget sets their bytes aside, ``cache/budget.py``), so
admission never reallocates it; only more live sequences than ``max_batch`` (tree search's forks) grow it,
between steps.
"""
from __future__ import annotations

import numpy as np
import torch

from plugins import ops as plugin_ops

from trtkv.cache.config import CacheConfig


class ResidualBuffer:
    """One request's residual buffer: its arena row. The positions buffered in each layer live in the arena's
    ``[rows, L, g]`` position and ``[rows, L]`` count arrays, so a batch's append is array operations."""

    def __init__(self, arena: ResidualArena, row: int) -> None:
        self._arena = arena
        self.row = row

    @property
    def k(self) -> torch.Tensor:
        """``[L, g, H, D]``, a view of the arena row."""
        return self._arena.k[self.row]

    @property
    def v(self) -> torch.Tensor:
        return self._arena.v[self.row]

    @property
    def nbytes(self) -> int:
        return self._arena.row_bytes

    def positions(self, layer: int) -> list[int]:
        """The buffered positions of ``layer``, in buffer order (a copy)."""
        return self._arena.pos[self.row, layer, : self._arena.fill[self.row, layer]].tolist()

    def count(self, layer: int) -> int:
        return int(self._arena.fill[self.row, layer])

    def append(self, layer: int, pos: int) -> None:
        n = self._arena.fill[self.row, layer]
        self._arena.pos[self.row, layer, n] = pos
        self._arena.fill[self.row, layer] = n + 1

    def take(self, layer: int) -> list[int]:
        """Empty ``layer``'s buffer (its tokens were written to pages); returns the positions it held."""
        pos = self.positions(layer)
        self._arena.fill[self.row, layer] = 0
        return pos

    def discard(self, layer: int, pos: int) -> bool:
        """Forget one buffered position (a rolled-back token); False when not buffered."""
        held = self.positions(layer)
        if pos not in held:
            return False
        held.remove(pos)
        self._arena.pos[self.row, layer, : len(held)] = held
        self._arena.fill[self.row, layer] = len(held)
        return True

    def copy_from(self, other: ResidualBuffer) -> None:
        """Hold ``other``'s buffered tokens (a fork: the buffer is copied, it is not paged)."""
        self.k.copy_(other.k)
        self.v.copy_(other.v)
        self._arena.pos[self.row] = self._arena.pos[other.row]
        self._arena.fill[self.row] = self._arena.fill[other.row]


class ResidualArena:
    def __init__(self, cfg: CacheConfig, rows: int | None = None) -> None:
        rows = max(1, rows or cfg.max_batch)
        shape = (rows, cfg.num_layers, cfg.residual_group, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode(False):  # a row is zeroed when it is handed out
            self.k = torch.empty(shape, dtype=cfg.residual_dtype, device=cfg.device)
            self.v = torch.empty_like(self.k)
        self.pos = np.zeros((rows, cfg.num_layers, cfg.residual_group), np.int64)  # buffered positions
        self.fill = np.zeros((rows, cfg.num_layers), np.int64)  # tokens buffered per row and layer
        self.free = list(range(rows - 1, -1, -1))  # pop() hands out the lowest row first

    @property
    def row_bytes(self) -> int:
        """Bytes of one request's buffer (K and V)."""
        return 2 * self.k[0].numel() * self.k.element_size()

    def acquire(self) -> ResidualBuffer:
        """A zeroed row (the arena doubles when every row is taken; buffers read their row through it)."""
        if not self.free:
            self._grow()
        row = self.free.pop()
        self.k[row].zero_()
        self.v[row].zero_()
        self.fill[row] = 0
        return ResidualBuffer(self, row)

    def release(self, buf: ResidualBuffer) -> None:
        self.free.append(buf.row)

    def _grow(self) -> None:
        old = self.k.shape[0]
        with torch.inference_mode(False):
            k = self.k.new_zeros((2 * old, *self.k.shape[1:]))
            v = torch.zeros_like(k)
            k[:old], v[:old] = self.k, self.v
        self.k, self.v = k, v
        self.pos = np.concatenate([self.pos, np.zeros_like(self.pos)])
        self.fill = np.concatenate([self.fill, np.zeros_like(self.fill)])
        self.free = list(range(2 * old - 1, old - 1, -1))

    def append_rows(self, layer: int, rows: np.ndarray, k: torch.Tensor, v: torch.Tensor,
                    positions: np.ndarray, distinct: bool | None = None) -> None:
        """Token ``i`` of ``k, v [b, H, D]`` goes to the next free slot of row ``rows[i]`` in ``layer`` (a row may
        repeat: a prompt's tail fills consecutive slots): one ``residual_append`` over flat row indices built in
        numpy, positions and counts as array writes. ``distinct``: whether ``rows`` repeat none (None: find out)."""
        _, L, g = self.k.shape[:3]
        fill = self.fill[rows, layer]
        repeated = len(rows) > 1 and len(np.unique(rows)) < len(rows) if distinct is None else not distinct
        if repeated:  # repeated requests (a prompt's tail): each repeat takes the slot after the previous one
            nxt: dict[int, int] = {}
            for i, r in enumerate(rows.tolist()):
                fill[i] = nxt.get(r, fill[i])
                nxt[r] = fill[i] + 1
        at = torch.from_numpy((rows * L + layer) * g + fill)
        plugin_ops.residual_append(self.k, self.v, at if self.k.device.type == "cpu" else at.to(self.k.device), k, v)
        self.pos[rows, layer, fill] = positions
        if repeated:
            np.add.at(self.fill[:, layer], rows, 1)
        else:
            self.fill[rows, layer] = fill + 1

    def plan_append(self, rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """One token of each of ``rows`` (distinct) recorded in every layer's buffer now, its K/V written later
        by ``residual_append`` at the flat indices returned: ``(at, fill) [layers, b]``, the fill after; None
        (nothing done) when a buffer would fill up (that step flushes it: ``append_rows`` layer by layer)."""
        _, L, g = self.k.shape[:3]
        fill = self.fill[rows].T  # [L, b]
        if (fill + 1 >= g).any() or len(np.unique(rows)) < len(rows):
            return None
        layers = np.arange(L)[:, None]
        self.pos[rows[None, :], layers, fill] = positions[None, :]
        self.fill[rows] += 1
        return (rows[None, :] * L + layers) * g + fill, fill + 1

    def holds_any(self, layer: int, rows: np.ndarray, positions: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Per job ``j`` (``counts[j]`` of ``positions``, of arena row ``rows[j]``): whether ``layer``'s buffer holds
        any of its positions, ``[len(rows)]`` bool."""
        fill = self.fill[rows, layer]
        none = np.zeros(len(rows), bool)
        if not fill.any():  # (nothing buffered: no comparison)
            return none
        buffered = self.pos[rows, layer]  # [jobs, g]
        filled = np.arange(buffered.shape[1]) < fill[:, None]
        # a job's positions are mostly older than everything its buffer holds: only the others are compared
        maybe = positions >= np.repeat(np.where(filled, buffered, np.iinfo(np.int64).max).min(1), counts)
        if not maybe.any():
            return none
        owner = np.repeat(np.arange(len(rows)), counts)[maybe]
        held = (buffered[owner] == positions[maybe][:, None]) & filled[owner]
        none[owner[held.any(1)]] = True
        return none

    def oldest_rows(self, rows: np.ndarray, layers: np.ndarray | None = None) -> np.ndarray:
        """The oldest position each of ``rows`` buffers in any layer, or in its one of ``layers`` (int64 max where
        none)."""
        if layers is None:
            filled = np.arange(self.pos.shape[2]) < self.fill[rows][:, :, None]
            return np.where(filled, self.pos[rows], np.iinfo(np.int64).max).min(axis=(1, 2))
        filled = np.arange(self.pos.shape[2]) < self.fill[rows, layers][:, None]
        return np.where(filled, self.pos[rows, layers], np.iinfo(np.int64).max).min(axis=1)

    def take_rows(self, layer: int, rows: np.ndarray, n: int) -> np.ndarray:
        """Empty ``layer``'s buffers of ``rows`` (each holding ``n`` tokens, written to pages): their positions
        ``[len(rows), n]``."""
        pos = self.pos[rows, layer, :n]
        self.fill[rows, layer] = 0
        return pos

    def rows(self, bufs: list[ResidualBuffer]) -> torch.Tensor:
        """Arena row of each of ``bufs``, ``[b]`` int64."""
        return _index([s.row for s in bufs], self.k.device)

    def counts_of(self, layer: int, rows: np.ndarray) -> torch.Tensor:
        """Buffered tokens of each of ``rows`` in ``layer``, ``[b]`` int64."""
        t = torch.from_numpy(self.fill[rows, layer])
        return t if self.k.device.type == "cpu" else t.to(self.k.device)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` through numpy (``torch.tensor`` of a list is ~2x slower on CPU)."""
    return torch.from_numpy(np.asarray(values, np.int64)).to(device)
