"""Flushing residual buffers: each request's ``g`` buffered tokens of one layer become one quantized group.

A decode step fills every request's buffer on the same step (they all started flushed, one token a step), so
the whole batch flushes together: one ``kv_write_groups`` call per format writes every request's group, and
the slots are marked live in one array operation, instead of one kernel call, one allocation record and one
validity update per request. Slots are allocated request by request, in batch order, exactly as a flush of
each would. In the common flush — one class, whole fresh pages for every request — the pages, their order
numbers and the key-scale groups are taken by array operations and the pages wait in the columns
(``FreshPages``) instead of joining each table's lists.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from plugins import ops as plugin_ops
from trtkv.cache.accounting import ByteAccount
from trtkv.cache.batch_alloc import add_fresh_pages_each, add_fresh_pages_layers, add_full_pages_each
from trtkv.cache.block_table import Cls
from trtkv.cache.columns import TableColumns
from trtkv.cache.pool import PagePool
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.residual import ResidualArena
from trtkv.cache.sequence import SeqKV


@dataclass
class FlushPlan:
    """A lockstep flush's fresh pages and key-scale groups, taken for every layer at once when the step's first
    layer flushes (``plan_flush``): layer ``l``'s ``pages[l]`` (``[G * per]``, request after request) and
    ``groups[l]``; a layer past ``len(pages)`` allocates as it flushes."""
    pages: list[np.ndarray]
    groups: list[np.ndarray]
    charges: tuple[list[ByteAccount], int] | None = None  # (accounts, bytes a layer): charged as each layer flushes

    def fresh(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        return (self.pages[layer], self.groups[layer]) if layer < len(self.pages) else None

    def charge(self, layer: int) -> None:
        """Layer ``layer``'s bytes, when the plan left them to its flush."""
        if self.charges is not None and layer < len(self.pages):
            ByteAccount.add_each(*self.charges)


def plan_flush(pools: PoolSet, arena: ResidualArena, columns: TableColumns, seqs: list[SeqKV], rows: np.ndarray,
               res_rows: np.ndarray, classes: list[Cls], order: Iterator[int], charge_each_layer: bool = False
               ) -> FlushPlan | None:
    """``_alloc_fresh`` of every layer at once, made when layer 0's buffers of ``seqs`` (every request of the step)
    fill and every other layer's fill with this step's token: one class, whole fresh pages in each layer. The
    layers from the first where that does not hold (a reusable slot, an open page, too few pages or groups) on
    allocate as they flush; None when none is planned. The same pages, groups, order numbers and bytes as the
    layers' flushes one after another (nothing between two layers' flushes touches another layer's tables).
    ``charge_each_layer``: each layer's bytes wait for its flush (``FlushPlan.charge``), so that releases between
    two layers' flushes (a policy acting in its layer before attention) leave each request's peak as it was."""
    cls = classes[0] if classes else None
    if cls is None or any(c != cls for c in classes):
        return None
    fill = arena.fill[res_rows]  # [G, layers]
    n, G = int(fill[0, 0]), len(seqs)
    if not n or not (fill[:, 0] == n).all() or not (fill[:, 1:] == n - 1).all():
        return None
    pool0 = pools.pool(0, cls[0])
    if n % pool0.B:
        return None
    per = n // pool0.B
    reusable = columns.reuse.counts(slice(None), rows, cls)
    bad = (columns.open_pages_all(rows, cls) >= 0).any(1)
    if reusable is not None:
        bad |= reusable.any(1)
    pages, groups = [], []
    for layer in range(int(np.argmax(bad)) if bad.any() else len(bad)):
        took = _take_fresh(pools.pool(layer, cls[0]), G, n, cls)
        if took is None:
            break
        pages.append(took[0])
        groups.append(took[1])
    if not pages:
        return None
    per_layer = add_fresh_pages_layers(seqs, columns, rows, pool0, cls, np.stack(pages).reshape(len(pages), G, per),
                                       order, extra=pool0.group_bytes if pool0.group_specs else 0,
                                       charge=not charge_each_layer)
    return FlushPlan(pages, groups, ([s.account for s in seqs], per_layer) if charge_each_layer else None)


def flush_many(pools: PoolSet, arena: ResidualArena, columns: TableColumns, layer: int, seqs: list[SeqKV],
               rows: np.ndarray, res_rows: np.ndarray, classes: list[Cls], segs: list[int], order: Iterator[int],
               clock=None, plan: FlushPlan | None = None) -> None:
    """Write the buffered tokens of ``seqs`` (rows ``rows`` of the columns, ``res_rows`` of the arena) in ``layer``
    to pages, request ``i`` as one group of class ``classes[i]`` (segment ``segs[i]``); requests of one format with
    equal fill share a kernel call. ``order``: the cache's page numbering; ``clock``: the decode-step profile clock
    (the kernel's time is "kv_write"); ``plan``: the step's pages and groups, when every request flushes and
    ``plan_flush`` took them."""
    fill = arena.fill[res_rows, layer]
    first = classes[0] if classes else None
    one_fmt = classes.count(first) == len(classes) or all(c[0] == first[0] for c in classes)  # (count: C-level)
    if one_fmt and len(seqs) and (fill == fill[0]).all():  # (a lockstep batch: every buffer full at once)
        calls = {(first[0], int(fill[0])): range(len(seqs))} if fill[0] else {}
    else:
        calls: dict[tuple[str, int], list[int]] = {}
        for i, n in enumerate(fill.tolist()):
            if n:
                calls.setdefault((classes[i][0], n), []).append(i)
    for (fmt, n), idx in calls.items():
        if len(idx) == len(seqs):
            if plan is not None:
                plan.charge(layer)
            _flush_call(pools, arena, columns, layer, fmt, n, seqs, rows, res_rows, classes, segs, order, clock,
                        None if plan is None else plan.fresh(layer))
        else:
            at = np.asarray(idx, np.int64)
            _flush_call(pools, arena, columns, layer, fmt, n, [seqs[i] for i in idx], rows[at], res_rows[at],
                        [classes[i] for i in idx], [segs[i] for i in idx], order, clock)


def _flush_call(pools: PoolSet, arena: ResidualArena, columns: TableColumns, layer: int, fmt: str, n: int,
                seqs: list[SeqKV], rows: np.ndarray, res_rows: np.ndarray, classes: list[Cls], segs: list[int],
                order: Iterator[int], clock, fresh: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    pool = pools.pool(layer, fmt)
    G = len(seqs)
    if fresh is None:
        fresh = _alloc_fresh(columns, layer, pool, n, seqs, rows, classes, order)
    if fresh is not None:
        pg, sl, gids = np.repeat(fresh[0], pool.B), np.tile(np.arange(pool.B, dtype=np.int64), len(fresh[0])), fresh[1]
    else:
        pages, slots = _alloc(columns, layer, pool, n, seqs, classes, order)
        gids = [s.alloc_group(layer, pool, n) for s in seqs]
        pg, sl = np.concatenate(pages), np.concatenate(slots)
    k, v = _buffers(arena, res_rows, layer, n)
    sc = pools.layer_scales(layer, fmt)
    clk = clock
    prev = clk.switch("kv_write") if clk is not None else None
    plugin_ops.kv_write_groups(k, v, pool.fields, pool.group_fields, pool.k_group,
                               torch.from_numpy(pg).view(G, n).to(pool.device),
                               torch.from_numpy(sl).view(G, n).to(pool.device),
                               torch.as_tensor(gids, dtype=torch.int64), pool.fmt.code, sc.k, sc.v)
    if clk is not None:
        clk.switch(prev)
    positions = arena.take_rows(layer, res_rows, n)  # [G, n]
    seg = segs[0] if segs.count(segs[0]) == len(segs) else np.repeat(np.asarray(segs, np.int64), n)
    if fresh is not None:  # whole fresh pages: a row a page
        pool.mark_pages_written(fresh[0], positions.reshape(-1, pool.B),
                                seg if np.ndim(seg) == 0 else seg.reshape(-1, pool.B))
    else:
        pool.mark_written(pg, sl, positions.reshape(-1), seg)
    columns.place_groups(layer, rows, fmt, pg.reshape(G, n), sl.reshape(G, n), positions)


def _alloc_fresh(columns: TableColumns, layer: int, pool: PagePool, n: int, seqs: list[SeqKV], rows: np.ndarray,
                 classes: list[Cls], order: Iterator[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The common flush by array operations: every request of one class, no reusable slot and no open page of
    it, ``n`` a whole number of pages that the pool and the key-scale arena have. ``(pages, key-scale groups)``,
    request after request (each page's slots in order), the ones ``_alloc`` and each request's ``alloc_group``
    give, with the same tables, order numbers and bytes; None (nothing done) otherwise. The pages wait in
    ``FreshPages``."""
    cls, B = classes[0], pool.B
    if n % B or any(c != cls for c in classes):
        return None
    reusable = columns.reuse.counts(layer, rows, cls)
    if (reusable is not None and reusable.any()) or (columns.open_pages(layer, rows, cls) >= 0).any():
        return None
    G = len(seqs)
    took = _take_fresh(pool, G, n, cls)
    if took is None:
        return None
    # (a request's group and pages charged at once: both only grow its bytes, so its peak is the same)
    add_fresh_pages_each(seqs, columns, layer, rows, pool, cls, took[0].reshape(G, n // B), order,
                         extra=pool.group_bytes if pool.group_specs else 0)
    return took


def _take_fresh(pool: PagePool, G: int, n: int, cls: Cls) -> tuple[np.ndarray, np.ndarray] | None:
    """``G`` key-scale groups of ``n`` tokens and ``G * n / B`` whole pages of ``cls`` from ``pool``, marked full:
    ``(pages, groups)``; None (nothing taken) when the pool or its arena lacks them."""
    per = n // pool.B
    if pool.free_pages < G * per:
        return None
    gids = pool.alloc_groups(G, n)
    if gids is None:
        return None
    got = pool.alloc_pages(G * per, cls[1])
    pool.mark_full(got)
    return got, gids


def _buffers(arena: ResidualArena, res_rows: np.ndarray, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` buffered tokens of arena rows ``res_rows`` in ``layer``, ``[G, n, H, D]``: a view of the arena
    when the rows are consecutive (a batch admitted together), else a gather (the kernel converts either)."""
    r0, G = int(res_rows[0]), len(res_rows)
    if (np.diff(res_rows) == 1).all():
        return arena.k[r0:r0 + G, layer, :n], arena.v[r0:r0 + G, layer, :n]
    rows = torch.from_numpy(res_rows).to(arena.k.device)
    return arena.k[rows, layer, :n], arena.v[rows, layer, :n]


def _alloc(columns: TableColumns, layer: int, pool: PagePool, n: int, seqs: list[SeqKV], classes: list[Cls],
           order: Iterator[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Slots for ``n`` tokens of each request, as ``BlockTable.alloc_slots`` of each in turn would choose
    them. The common case — a group exactly filling fresh pages (no reusable slot, no open page of the class)
    — takes a run of consecutive such requests' pages from the pool in one call; the others go through
    ``alloc_slots`` in their place in the batch, so every request gets the pages it would get in order."""
    B, per = pool.B, n // pool.B
    pages: list = [None] * len(seqs)
    slots: list = [None] * len(seqs)
    run: list[int] = []  # consecutive requests of one page class on the fast path, not yet allocated

    def fresh(j: int) -> bool:
        return n % B == 0 and seqs[j].layers[layer].needs_fresh_pages(classes[j])

    def take_run() -> None:
        got = pool.alloc_pages(len(run) * per, classes[run[0]][1]) if run else None
        if got is None:  # too few pages left: one by one, so the error names the request that ran out
            for j in run:
                pages[j], slots[j] = seqs[j].layers[layer].alloc_slots(pool, classes[j], n)
        else:
            _give_pages(columns, layer, pool, seqs, classes, run, got, per, pages, slots, order)
        run.clear()

    for j in range(len(seqs)):
        if fresh(j) and (not run or classes[run[0]][1] == classes[j][1]):
            run.append(j)
            continue
        take_run()
        if fresh(j):
            run.append(j)
        else:
            pages[j], slots[j] = seqs[j].layers[layer].alloc_slots(pool, classes[j], n)
    take_run()
    return pages, slots


def _give_pages(columns: TableColumns, layer: int, pool: PagePool, seqs: list[SeqKV], classes: list[Cls],
                run: list[int], got: np.ndarray, per: int, pages: list, slots: list, order: Iterator[int]) -> None:
    """Record ``per`` fresh pages of ``got`` (whole, in order) in each of the ``run`` requests' tables."""
    B = pool.B
    pool.mark_full(got)
    every_slot = np.repeat(got, B)
    full_slots = np.tile(np.arange(B, dtype=np.int64), per)
    rows = np.fromiter((seqs[j].row for j in run), np.int64, len(run))
    add_full_pages_each([seqs[j].layers[layer] for j in run], columns, layer, rows, pool,
                        [classes[j] for j in run], got.reshape(len(run), per), order)
    for i, j in enumerate(run):
        pages[j] = every_slot[i * per * B:(i + 1) * per * B]
        slots[j] = full_slots
