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
    """One request's residual buffer: its arena row and the positions buffered in each layer."""

    def __init__(self, arena: ResidualArena, row: int, num_layers: int) -> None:
        self._arena = arena
        self.row = row
        self._pos: list[list[int]] = [[] for _ in range(num_layers)]

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
        """The buffered positions of ``layer``, in buffer order (read-only)."""
        return self._pos[layer]

    def count(self, layer: int) -> int:
        return len(self._pos[layer])

    def append(self, layer: int, pos: int) -> None:
        self._pos[layer].append(pos)

    def take(self, layer: int) -> list[int]:
        """Empty ``layer``'s buffer (its tokens were written to pages); returns the positions it held."""
        pos, self._pos[layer] = self._pos[layer], []
        return pos

    def discard(self, layer: int, pos: int) -> bool:
        """Forget one buffered position (a rolled-back token); False when not buffered."""
        if pos in self._pos[layer]:
            self._pos[layer].remove(pos)
            return True
        return False

    def copy_from(self, other: ResidualBuffer) -> None:
        """Hold ``other``'s buffered tokens (a fork: the buffer is copied, it is not paged)."""
        self.k.copy_(other.k)
        self.v.copy_(other.v)
        self._pos = [list(other.positions(layer)) for layer in range(len(self._pos))]


class ResidualArena:
    def __init__(self, cfg: CacheConfig, rows: int | None = None) -> None:
        rows = max(1, rows or cfg.max_batch)
        shape = (rows, cfg.num_layers, cfg.residual_group, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode(False):  # a row is zeroed when it is handed out
            self.k = torch.empty(shape, dtype=cfg.residual_dtype, device=cfg.device)
            self.v = torch.empty_like(self.k)
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
        return ResidualBuffer(self, row, self.k.shape[1])

    def release(self, buf: ResidualBuffer) -> None:
        self.free.append(buf.row)

    def _grow(self) -> None:
        old = self.k.shape[0]
        with torch.inference_mode(False):
            k = self.k.new_zeros((2 * old, *self.k.shape[1:]))
            v = torch.zeros_like(k)
            k[:old], v[:old] = self.k, self.v
        self.k, self.v = k, v
        self.free = list(range(2 * old - 1, old - 1, -1))

    def append(self, layer: int, bufs: list[ResidualBuffer], k: torch.Tensor, v: torch.Tensor,
               positions: list[int]) -> None:
        """Token ``i`` of ``k, v [b, H, D]`` goes to the next free slot of ``bufs[i]`` in ``layer`` (a buffer
        may appear several times: a prompt's tail fills consecutive slots). One ``residual_append`` over flat
        row indices built in numpy (the CPU kernel converts and stores the rows in place)."""
        _, L, g = self.k.shape[:3]
        b = len(bufs)
        rows = np.fromiter((s.row for s in bufs), np.int64, b)
        fill = np.fromiter((s.count(layer) for s in bufs), np.int64, b)
        if len(set(rows.tolist())) < b:  # repeated requests: each repeat takes the slot after the previous one
            nxt: dict[int, int] = {}
            for i, r in enumerate(rows.tolist()):
                fill[i] = nxt.get(r, fill[i])
                nxt[r] = fill[i] + 1
        at = torch.from_numpy((rows * L + layer) * g + fill).to(self.k.device)
        plugin_ops.residual_append(self.k, self.v, at, k, v)
        for s, p in zip(bufs, positions):
            s.append(layer, p)

    def gather(self, layer: int, bufs: list[ResidualBuffer]) -> tuple[torch.Tensor, torch.Tensor]:
        """``bufs``' tokens of ``layer``: ``k, v [b, g, H, D]`` (a copy)."""
        rows = self.rows(bufs)
        return self.k[rows, layer], self.v[rows, layer]

    def rows(self, bufs: list[ResidualBuffer]) -> torch.Tensor:
        """Arena row of each of ``bufs``, ``[b]`` int64."""
        return _index([s.row for s in bufs], self.k.device)

    def counts(self, layer: int, bufs: list[ResidualBuffer]) -> torch.Tensor:
        """Buffered tokens of each of ``bufs`` in ``layer``, ``[b]`` int64."""
        return _index([s.count(layer) for s in bufs], self.k.device)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` through numpy (``torch.tensor`` of a list is ~2x slower on CPU)."""
    return torch.from_numpy(np.asarray(values, np.int64)).to(device)
