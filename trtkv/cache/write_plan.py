"""A decode step's write-through slots for every layer, allocated at once.

A write-through step stores one token of every request in every layer. Layer by layer, the slot bookkeeping
(kept reusable slots, open pages, tail slots, validity, position maps) costs a few array operations per layer;
with each format's slot state stacked over the layers (``SlotStack``) and the tables' columns
``[layers, rows]``, the step does them once for every layer, and each layer's write is then its kernel call.

The same slots and state as ``write_through`` layer after layer (``batch_alloc.alloc_one_each``): a request's
reusable slot where it has one (a sliding window's or a scorer's evictions), else its open page's next tail
slot, opening fresh pages layer by layer in layer order. The plan is made when the step's first layer writes,
and only when nothing between two layers' writes changes another layer's tables (the policy has no
``before_attention``, there are no host tiers).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from trtkv.cache.batch_alloc import alloc_one_each, open_fresh_pages_layers
from trtkv.cache.block_table import Cls
from trtkv.cache.columns import TableColumns
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.sequence import SeqKV


@dataclass
class WritePlan:
    """Where each request's token goes in every layer: ``pages, slots [layers, batch]`` (on the pools' device)."""
    cls: Cls
    pages: torch.Tensor
    slots: torch.Tensor


def plan_write_through(pools: PoolSet, columns: TableColumns, seqs: list[SeqKV], rows: np.ndarray,
                       positions: np.ndarray, cls: Cls, order: Iterator[int]) -> WritePlan | None:
    """Allocate and record the slots of one token of each of ``seqs`` (rows ``rows``, distinct) at ``positions``
    in every layer (``order``: the cache's page numbering); None (nothing done) when the plan does not apply (see
    the module docstring)."""
    fmt = cls[0]
    stack = pools.stack(fmt)
    if stack is None:  # the format's first write: every layer's pool made now
        for layer in range(columns.num_layers):
            pools.pool(layer, fmt)
        stack = pools.stack(fmt)
    if stack is None:
        return None
    device = pools.pool(0, fmt).device
    took = _take_reusable(stack, columns, rows, cls)
    opens = columns.open_pages_all(rows, cls)
    short = (opens < 0) if took is None else (opens < 0) & ~took[0]
    if short.any():  # page boundaries: fresh pages, layer by layer
        open_fresh_pages_layers(seqs, columns, rows, short, lambda layer: pools.pool(layer, fmt), cls, order)
        opens = columns.open_pages_all(rows, cls)
    if took is None:  # every request takes its open page's tail in every layer (the common step)
        pages, slots = opens, stack.take_tails(opens)
        closed = slots + 1 >= stack.B
    else:
        kept, pages, slots = took
        li, j = np.nonzero(~kept)
        pages[li, j] = opens[li, j]
        slots[li, j] = start = stack.take_tails(opens[li, j], li)
        closed = np.zeros(kept.shape, bool)
        closed[li, j] = start + 1 >= stack.B
    if closed.any():  # a page's last tail slot: it is no longer the class's open page
        columns.close_rows_all(rows, cls, closed)
    stack.mark_written_distinct(pages, slots, positions)
    columns.place_rows_all(rows, fmt, pages, slots, positions)
    return _plan_on(device, cls, pages, slots)


def plan_each_layer(pools: PoolSet, columns: TableColumns, seqs: list[SeqKV], rows: np.ndarray,
                    positions: np.ndarray, cls: Cls, order: Iterator[int]) -> WritePlan:
    """The plan of a step ``plan_write_through`` does not cover: ``write_through``'s allocation and records, layer
    after layer, without the codes. The same slots and state as
    ``write_through`` when nothing between two layers' writes changes the tables."""
    pages, slots = [], []
    for layer in range(columns.num_layers):
        pool = pools.pool(layer, cls[0])
        p, s = alloc_one_each(seqs, columns, layer, rows, pool, cls, order)
        pool.mark_written_distinct(p, s, positions)
        columns.place_rows(layer, rows, cls[0], p, s, positions)
        pages.append(p)
        slots.append(s)
    return _plan_on(pool.device, cls, np.stack(pages), np.stack(slots))


def _plan_on(device: torch.device, cls: Cls, pages: np.ndarray, slots: np.ndarray) -> WritePlan:
    """A plan of ``pages, slots [layers, batch]`` on ``device`` (on CPU, views of the arrays)."""
    pages_t, slots_t = torch.from_numpy(pages), torch.from_numpy(slots)
    if device.type != "cpu":
        pages_t, slots_t = pages_t.to(device), slots_t.to(device)
    return WritePlan(cls, pages_t, slots_t)


def _take_reusable(stack, columns: TableColumns, rows: np.ndarray, cls: Cls
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Each request's next reusable slot in every layer (``ReusableSlots``; a slot refilled since it was freed is
    dropped): ``(taken [layers, n], pages, slots)`` with the taken entries filled; None when no request has one
    in any layer."""
    counts = columns.reuse.counts(slice(None), rows, cls)
    if counts is None:
        return None
    L, n = counts.shape
    full = bool(counts.all())  # (every request has one in every layer: a one-victim-a-step policy's steady state)
    li, j = (np.repeat(np.arange(L), n), np.tile(np.arange(n), L)) if full else np.nonzero(counts)
    if not len(li):
        return None
    p, s = columns.reuse.take_one_each(li, rows[j], cls, stack.slots_free)
    got = p >= 0
    if full and got.all():
        return np.ones(counts.shape, bool), p.reshape(counts.shape), s.reshape(counts.shape)
    taken = np.zeros(counts.shape, bool)
    pages = np.full(counts.shape, -1, np.int64)
    slots = np.zeros(counts.shape, np.int64)
    li, j = li[got], j[got]
    taken[li, j] = True
    pages[li, j], slots[li, j] = p[got], s[got]
    return taken, pages, slots
