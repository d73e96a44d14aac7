"""Writes in two halves, for a runtime that encodes K/V elsewhere (the ONNX graphs, trtkv/export): ``reserve``
allocates the slots (and key-scale group) and records the tokens live, exactly as ``KVCacheManager.write``
does; ``store`` copies the encoded records into them once they exist. In between, the slots are live in the
host's metadata but hold no codes yet, so a reader must not attend them (the graph attends the step's write
unit from its own records instead).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.cache.manager import Cls, KVCacheManager, SeqKV
from trtkv.cache.pool import PagePool


@dataclass
class PendingWrite:
    pool: PagePool
    pages: np.ndarray
    slots: np.ndarray
    gid: int  # key-scale arena entry (-1: the format has none)


def reserve(cache: KVCacheManager, seq: SeqKV, layer: int, cls: Cls, positions: list[int],
            seg: int = -1) -> PendingWrite:
    """Allocate and record ``positions`` (one flush group, or write-through tokens) of one request."""
    pool = cache.pool(layer, cls[0])
    pages, slots = cache.alloc_slots(seq, layer, cls, len(positions))
    gid = seq.alloc_group(layer, pool, len(positions))
    cache.record_written(seq, layer, pool, cls[0], pages, slots, positions, seg)
    return PendingWrite(pool, pages, slots, gid)


def store(w: PendingWrite, slot_records: list[torch.Tensor], group_records: list[torch.Tensor]) -> None:
    """Copy ``slot_records [n, *shape]`` into the reserved slots and ``group_records [*shape]`` into the
    arena entry (the pool may have grown since ``reserve``: its current tensors are written)."""
    pool = w.pool
    p, s = torch.from_numpy(w.pages).to(pool.device), torch.from_numpy(w.slots).to(pool.device)
    for field, rec in zip(pool.fields, slot_records):
        field[p, s] = rec.to(field.device)
    for arena, rec in zip(pool.group_fields, group_records):
        arena[w.gid] = rec.to(arena.device)
    if group_records:
        pool.k_group[p, s] = w.gid


def pending_bits(writes: list[PendingWrite]) -> dict[int, np.ndarray]:
    """Per pool (by ``id``) the validity words with every reserved-but-unstored slot cleared."""
    out: dict[int, np.ndarray] = {}
    for w in writes:
        words = out.get(id(w.pool))
        if words is None:
            words = out[id(w.pool)] = w.pool.valid.copy()
        for p, s in zip(w.pages.tolist(), w.slots.tolist()):
            words[p] &= ~np.int32(1 << s)
    return out
