"""Residual buffers of all requests as rows of one shared arena.

A quantizing policy holds each request's last ``g`` tokens per layer in full precision until they flush as
one group. Each request's buffer (``SeqKV.buf_k/buf_v``, ``[L, g, H, D]``) is a view of one row of a shared
``[rows, L, g, H, D]`` pair, so a decode step appends the whole batch's new K/V in one indexed write per
layer and attention reads the batch's buffers in one gather, instead of one small copy per request.

The arena has ``max_batch`` rows from the start (the KV budget sets their bytes aside, ``cache/budget.py``), so
admission never reallocates it; only more live sequences than ``max_batch`` (tree search's forks) grow it,
between steps.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from plugins import ops as plugin_ops

if TYPE_CHECKING:
    from trtkv.cache.manager import CacheConfig, SeqKV


class ResidualArena:
    def __init__(self, cfg: CacheConfig, rows: int | None = None) -> None:
        rows = max(1, rows or cfg.max_batch)
        shape = (rows, cfg.num_layers, cfg.residual_group, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode(False):  # a row is zeroed when it is handed out
            self.k = torch.empty(shape, dtype=cfg.residual_dtype, device=cfg.device)
            self.v = torch.empty_like(self.k)
        self.free = list(range(rows - 1, -1, -1))  # pop() hands out the lowest row first

    def acquire(self, seq: SeqKV, live: list[SeqKV]) -> None:
        """Give ``seq`` a zeroed row (growing the arena, and re-pointing the ``live`` requests' views, when
        every row is taken)."""
        if not self.free:
            self._grow(live)
        row = self.free.pop()
        self.k[row].zero_()
        self.v[row].zero_()
        seq.buf_row = row
        seq.buf_k, seq.buf_v = self.k[row], self.v[row]

    def release(self, seq: SeqKV) -> None:
        if seq.buf_row >= 0:
            self.free.append(seq.buf_row)
            seq.buf_row = -1

    def _grow(self, live: list[SeqKV]) -> None:
        old = self.k.shape[0]
        with torch.inference_mode(False):
            k = self.k.new_zeros((2 * old, *self.k.shape[1:]))
            v = torch.zeros_like(k)
            k[:old], v[:old] = self.k, self.v
        self.k, self.v = k, v
        self.free = list(range(2 * old - 1, old - 1, -1))
        for s in live:
            if s.buf_row >= 0:
                s.buf_k, s.buf_v = k[s.buf_row], v[s.buf_row]

    def append(self, layer: int, seqs: list[SeqKV], k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> None:
        """Token ``i`` of ``k, v [b, H, D]`` goes to the next free buffer slot of ``seqs[i]`` in ``layer`` (a
        request may appear several times: a prompt's tail fills consecutive slots). One ``residual_append``
        over flat row indices built in numpy (the CPU kernel converts and stores the rows in place)."""
        _, L, g = self.k.shape[:3]
        b = len(seqs)
        rows = np.fromiter((s.buf_row for s in seqs), np.int64, b)
        fill = np.fromiter((len(s.buf_pos[layer]) for s in seqs), np.int64, b)
        if len(set(rows.tolist())) < b:  # repeated requests: each repeat takes the slot after the previous one
            nxt: dict[int, int] = {}
            for i, r in enumerate(rows.tolist()):
                fill[i] = nxt.get(r, fill[i])
                nxt[r] = fill[i] + 1
        at = torch.from_numpy((rows * L + layer) * g + fill).to(self.k.device)
        plugin_ops.residual_append(self.k, self.v, at, k, v)
        for s, p in zip(seqs, positions):
            s.buf_pos[layer].append(p)

    def gather(self, layer: int, seqs: list[SeqKV]) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers of ``seqs`` in ``layer``: ``k, v [b, g, H, D]`` (a copy)."""
        rows = self.rows(seqs)
        return self.k[rows, layer], self.v[rows, layer]

    def rows(self, seqs: list[SeqKV]) -> torch.Tensor:
        """Arena row of each of ``seqs``, ``[b]`` int64."""
        return _index([s.buf_row for s in seqs], self.k.device)

    def counts(self, layer: int, seqs: list[SeqKV]) -> torch.Tensor:
        """Buffered tokens of each of ``seqs`` in ``layer``, ``[b]`` int64."""
        return _index([len(s.buf_pos[layer]) for s in seqs], self.k.device)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` through numpy (``torch.tensor`` of a list is ~2x slower on CPU)."""
    return torch.from_numpy(np.asarray(values, np.int64)).to(device)
