"""Slot and page allocation for a batch of block tables in one layer, by array operations.

A decode step writes one token of every request; a flush writes whole pages of many. Table by table that is
Python work per (request, layer); these functions do a batch's allocation with a few array operations on the
columns (``TableColumns``) and the pool, and reach each table only through its verbs where a row needs its
own rules (a full pool). The same slots and state as each table's own ``alloc_slots`` (property tests in
tests/test_cache_properties.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice

import numpy as np

from trtkv.cache.accounting import ByteAccount
from trtkv.cache.block_table import BlockTable, held_page_bytes
from trtkv.cache.columns import Cls, TableColumns
from trtkv.cache.fresh_pages import DEPTH as FRESH_DEPTH
from trtkv.cache.index_ops import split_counts
from trtkv.cache.pool import PagePool

__all__ = ["alloc_one_each", "alloc_slots_each", "open_fresh_pages", "open_fresh_pages_layers",
           "add_full_pages_each"]


def alloc_one_each(seqs: list, cols: TableColumns, layer: int, rows: np.ndarray, pool: PagePool, cls: Cls,
                   order: Iterator[int]) -> tuple[np.ndarray, np.ndarray]:
    """One slot of ``cls`` for one token of each of ``rows`` (distinct requests ``seqs``, one layer; ``order``: the
    cache's page numbering), as each table's ``alloc_slots`` would give it, by array operations: a reusable slot
    where the row has one (``ReusableSlots``), else its open page's next tail slot, rows with neither getting
    new pages in one pool call. (Each array operation costs microseconds inside a decode step: a layer of the
    common case, nothing reusable, takes a handful.)"""
    n = len(rows)
    pages, slots = np.full(n, -1, np.int64), np.zeros(n, np.int64)
    reused = np.zeros(n, bool)
    counts = cols.reuse.counts(layer, rows, cls)
    if counts is not None and counts.any():
        at = np.flatnonzero(counts)
        p, s = cols.reuse.take_one_each(layer, rows[at], cls, pool.slots_free)
        got = p >= 0
        pages[at[got]], slots[at[got]] = p[got], s[got]
        reused[at[got]] = True
    opens = cols.open_pages(layer, rows, cls)
    need = np.flatnonzero((opens < 0) & ~reused)
    if len(need):
        open_fresh_pages(seqs, cols, layer, rows, need, pool, cls, order)
        opens = cols.open_pages(layer, rows, cls)
    if not reused.any():  # every row takes its open page's tail (the common step)
        pages, slots = opens, pool.take_tails(opens)
        tail = np.arange(n)
    else:
        tail = np.flatnonzero(~reused)
        pages[tail] = opens[tail]
        slots[tail] = pool.take_tails(opens[tail])
    closed = tail[slots[tail] + 1 >= pool.B]
    if len(closed):  # a page's last tail slot: it is no longer the class's open page
        cols.close_rows(layer, rows[closed], cls)
    return pages, slots


def alloc_slots_each(seqs: list, cols: TableColumns, layer: int, rows: np.ndarray, pool: PagePool, cls: Cls,
                     counts: np.ndarray, order: Iterator[int], queue: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``counts[i]`` slots of ``cls`` for each of ``rows`` (distinct requests ``seqs``, one layer; ``order``: the
    cache's page numbering), the ones each table's ``alloc_slots`` would give in turn: its reusable slots first,
    then its open page's tail, then new pages - taken from the pool in one call, in row order (a host tier's
    batch of moves, a packed prefill's prompts). New pages wait in ``FreshPages`` when ``queue`` and they fit,
    else join the tables' lists at once. Returns ``(pages, slots)`` of every row's slots, concatenated in row
    order."""
    counts = np.asarray(counts, np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    pages, slots = np.empty(int(bounds[-1]), np.int64), np.empty(int(bounds[-1]), np.int64)
    p, sl, got = cols.reuse.take_each(layer, rows, cls, counts, pool.slots_free)
    if len(p):  # each row's own reusable slots
        dst = np.repeat(bounds[:-1], got) + _ranks(got)
        pages[dst], slots[dst] = p, sl
    opens = cols.open_pages(layer, rows, cls)
    at = np.flatnonzero((counts > got) & (opens >= 0))
    if len(at):  # the open pages' tails
        start = pool.hwm[opens[at]].astype(np.int64)
        take = np.minimum(pool.B - start, counts[at] - got[at])
        pool.hwm[opens[at]] = start + take
        _fill(pages, slots, bounds[at] + got[at], take, opens[at], start)
        got[at] += take
        full = at[start + take >= pool.B]
        if len(full):
            cols.close_rows(layer, rows[full], cls)
    need = np.flatnonzero(counts > got)
    if not len(need):
        return pages, slots
    rest = counts[need] - got[need]
    per = -(-rest // pool.B)  # new pages each
    fresh = pool.alloc_pages(int(per.sum()), cls[1])
    if fresh is None:  # the pool lacks them: table by table, a full pool names its request
        for i, n in zip(need.tolist(), rest.tolist()):
            p, sl = seqs[i].layers[layer].alloc_slots(pool, cls, n)
            pages[bounds[i] + got[i]:bounds[i + 1]], slots[bounds[i] + got[i]:bounds[i + 1]] = p, sl
        return pages, slots
    # row i's tokens fill its new pages in order: the k-th token at (page k // B, slot k % B)
    k = _ranks(rest)
    dst = np.repeat(bounds[need] + got[need], rest) + k
    pages[dst], slots[dst] = fresh[np.repeat(np.cumsum(per) - per, rest) + k // pool.B], k % pool.B
    pool.mark_full(fresh)
    last = fresh[np.cumsum(per) - 1]
    partial = rest % pool.B != 0
    pool.hwm[last[partial]] = rest[partial] % pool.B
    cost = held_page_bytes(pool)
    grid = fresh[:, None] if (per == 1).all() else np.full((len(need), int(per.max())), -1, np.int64)
    if grid.shape[1] > 1:  # (row i's pages in its first per[i] columns)
        grid[np.repeat(np.arange(len(need)), per), _ranks(per)] = fresh
    if not queue or per.max() > FRESH_DEPTH:  # each table takes its pages in its lists (a prompt's are not
        # queued: the queue would fill halfway to a later page boundary, and every table then takes its pages in)
        at_end = np.fromiter((seqs[i].layers[layer].hold_fresh(cls, ps.tolist(), cost * len(ps))
                              for i, ps in zip(need.tolist(), split_counts(fresh, per))), bool, len(need))
        cols.changes.append_rows(layer, rows[need], cols.fmt_id(cls[0]), grid, at_end)
    else:  # they wait in FreshPages, as a page boundary's do
        _queue_pages(lambda j: seqs[need[j]].layers[layer], cols, layer, rows[need], cols.fmt_id(cls[0]), cls, grid,
                     order)
        ByteAccount.add_each([seqs[i].account for i in need.tolist()], (cost * per).tolist())
    if partial.any():  # a last page with tail left stays the class's open page (as ``new_page`` made it)
        cols.set_opens(layer, rows[need[partial]], cls, last[partial])
    return pages, slots


def _fill(pages: np.ndarray, slots: np.ndarray, at: np.ndarray, n: np.ndarray, page: np.ndarray,
          start: np.ndarray) -> None:
    """``pages[at[i]:at[i] + n[i]] = page[i]``, ``slots[...] = start[i], start[i] + 1, ...`` for every i."""
    k = _ranks(n)
    idx = np.repeat(at, n) + k
    pages[idx], slots[idx] = np.repeat(page, n), np.repeat(start, n) + k


def _ranks(n: np.ndarray) -> np.ndarray:
    """``0..n[0]-1, 0..n[1]-1, ...``: each element's place in its run of a concatenation of runs ``n``."""
    return np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)


def open_fresh_pages(seqs: list, cols: TableColumns, layer: int, rows: np.ndarray, need: np.ndarray,
                     pool: PagePool, cls: Cls, order: Iterator[int]) -> None:
    """A fresh open page of ``cls`` for each of ``rows[need]`` (``seqs[i]``: the request of ``rows[i]``), taken
    from ``pool`` in one call when it has them all; they wait in ``FreshPages``."""
    pages = pool.alloc_pages(len(need), cls[1])
    if pages is None:
        _each_opens_its_own(seqs, layer, need, pool, cls)
        return
    _queue_layers(seqs, cols, rows, [(layer, need, pages)], cls, order)
    ByteAccount.add_each([seqs[i].account for i in need.tolist()], held_page_bytes(pool))


def open_fresh_pages_layers(seqs: list, cols: TableColumns, rows: np.ndarray, short: np.ndarray,
                            pool_of: Callable[[int], PagePool], cls: Cls, order: Iterator[int]) -> None:
    """``open_fresh_pages`` for ``rows[short[l]]`` in each layer ``l`` (``pool_of(l)``: the layer's pool): pages taken
    layer by layer, then waiting in ``FreshPages`` for every layer in one pass; each request charged once for all
    its layers."""
    charge = np.zeros(len(rows), np.int64)
    taken: list[tuple[int, np.ndarray, np.ndarray]] = []  # (layer, need, pages) not yet queued
    for layer in np.flatnonzero(short.any(1)).tolist():
        need = np.flatnonzero(short[layer])
        pool = pool_of(layer)
        pages = pool.alloc_pages(len(need), cls[1])
        if pages is None:
            _queue_layers(seqs, cols, rows, taken, cls, order)  # (the pages taken before, numbered first)
            taken = []
            _each_opens_its_own(seqs, layer, need, pool, cls)
            continue
        taken.append((layer, need, pages))
        charge[need] += held_page_bytes(pool)
    _queue_layers(seqs, cols, rows, taken, cls, order)
    at = np.flatnonzero(charge)
    ByteAccount.add_each([seqs[i].account for i in at.tolist()], charge[at].tolist())


def _each_opens_its_own(seqs: list, layer: int, need: np.ndarray, pool: PagePool, cls: Cls) -> None:
    """The pool lacks a page for each of ``seqs[need]``: each table opens its own in turn, so a full pool names the
    request that ran out (bytes charged)."""
    for i in need.tolist():
        seqs[i].layers[layer].new_page(pool, cls)


def _queue_layers(seqs: list, cols: TableColumns, rows: np.ndarray, taken: list[tuple[int, np.ndarray, np.ndarray]],
                  cls: Cls, order: Iterator[int]) -> None:
    """Each ``(layer, need, pages)`` of ``taken``: page ``pages[i]`` is the open page of ``rows[need[i]]`` in
    ``layer``, waiting in ``FreshPages`` instead of joining the tables' lists; every layer's in one ``_queue_pages``
    (numbered layer after layer)."""
    if not taken:
        return
    layers = np.concatenate([np.full(len(need), layer, np.int64) for layer, need, _ in taken])
    need = np.concatenate([need for _, need, _ in taken])
    pages = np.concatenate([pages for _, _, pages in taken])
    _queue_pages(lambda j: seqs[need[j]].layers[layers[j]], cols, layers, rows[need], cols.fmt_id(cls[0]), cls,
                 pages[:, None], order)
    cols.set_opens(layers, rows[need], cls, pages)


def add_fresh_pages_each(seqs: list, cols: TableColumns, layer: int, rows: np.ndarray, pool: PagePool, cls: Cls,
                         pages: np.ndarray, order: Iterator[int], extra: int = 0) -> None:
    """``add_full_pages_each`` of one class as ``FreshPages`` entries: the ``[G, per]`` pages just taken from
    ``pool`` and filled at once join ``seqs[i]``'s table (row ``rows[i]``) in ``layer``, numbered table after
    table as ``hold_fresh`` numbers them, and the batch's block tables take them in place; each request is charged
    once (``extra`` more bytes with them: its key-scale group)."""
    _queue_pages(lambda j: seqs[j].layers[layer], cols, layer, rows, cols.fmt_id(cls[0]), cls, pages, order)
    ByteAccount.add_each([s.account for s in seqs], pages.shape[1] * held_page_bytes(pool) + extra)


def add_fresh_pages_layers(seqs: list, cols: TableColumns, rows: np.ndarray, pool: PagePool, cls: Cls,
                           pages: np.ndarray, order: Iterator[int], extra: int = 0, charge: bool = True) -> int:
    """``add_fresh_pages_each`` of layers ``0 .. len(pages) - 1`` at once: ``pages [layers, G, per]`` (each layer's
    pools alike, ``pool`` one of them), numbered layer after layer and in each table after table, as that many calls
    layer by layer would number them; each request is charged once for all of them (only growing, so the same peak),
    or not at all (``charge=False``: the caller charges layer by layer). Returns a request's bytes a layer."""
    L, G, per = pages.shape
    _queue_pages(lambda j: seqs[j % G].layers[j // G], cols, np.repeat(np.arange(L), G), np.tile(rows, L),
                 cols.fmt_id(cls[0]), cls, pages.reshape(L * G, per), order)
    per_layer = per * held_page_bytes(pool) + extra
    if charge:
        ByteAccount.add_each([s.account for s in seqs], L * per_layer)
    return per_layer


def _queue_pages(table_of: Callable[[int], BlockTable], cols: TableColumns, layer: int | np.ndarray, rows: np.ndarray,
                 fmt_id: int, cls: Cls, pages: np.ndarray, order: Iterator[int]) -> None:
    """Pages ``pages[i]`` (``[n, per]``, in order; a row may end in -1 padding) of ``cls`` wait in ``FreshPages`` for
    ``table_of(i)`` (row ``rows[i]`` of ``layer``, or of ``layer[i]``), numbered from ``order`` table after table;
    the batch's block tables take them in place. Rows whose queue cannot take theirs take the waiting ones in first
    (the only tables looked up: a batch's 8,192 lookups at a page boundary cost ~4 ms). Bytes are the caller's."""
    n, per = pages.shape
    fresh = cols.fresh
    valid = pages >= 0  # (row-major: table after table, each table's pages in order)
    ragged = not valid.all()
    counts = valid.sum(1) if ragged else per
    for i in np.flatnonzero(fresh.full(layer, rows, counts)).tolist():
        table_of(i).take_waiting_pages()
    total = int(np.sum(counts)) if ragged else n * per
    at_end = fresh.list_classes(layer, rows, fmt_id, cls[1])
    layers = np.broadcast_to(layer, (n,))
    for j in range(per):
        has = valid[:, j] if ragged else slice(None)
        fresh.add(layers[has] if np.ndim(layer) else layer, rows[has], fmt_id, pages[has, j], cls[1])
    cols.reuse.note_orders(np.repeat(layer, counts) if np.ndim(layer) else layer, cls[0], pages[valid],
                           np.fromiter(islice(order, total), np.int64, total))
    cols.changes.append_rows(layer, rows, fmt_id, pages if per > 1 else pages[:, 0], at_end)


def add_full_pages_each(tables: list[BlockTable], cols: TableColumns, layer: int, rows: np.ndarray,
                        pool: PagePool, classes: list[Cls], pages: np.ndarray, order: Iterator[int]) -> None:
    """Pages just taken from ``pool`` and filled at once (a batch's flush of whole pages): ``tables[i]``
    (distinct, rows ``rows``) holds ``pages[i]`` (a row of ``[G, per]``), never open, numbered from ``order``
    table after table as ``hold_fresh`` numbers them (noted in one call a format). In one format, the columns
    record them as appended, so the batch's block tables take them in place."""
    G, per = pages.shape
    orders = np.fromiter(islice(order, G * per), np.int64, G * per).reshape(G, per)
    fmts = [cls[0] for cls in classes]
    one_fmt = len(set(fmts)) == 1
    for fmt in dict.fromkeys(fmts):
        mine = slice(None) if one_fmt else np.asarray([f == fmt for f in fmts])
        cols.reuse.note_orders(layer, fmt, pages[mine].reshape(-1), orders[mine].reshape(-1))
    cost = per * held_page_bytes(pool)
    at_end = np.fromiter((t.hold_numbered(cls, ps, cost) for t, cls, ps in zip(tables, classes, pages.tolist())),
                         bool, G)
    if one_fmt:
        cols.changes.append_rows(layer, rows, cols.fmt_id(fmts[0]), pages, at_end)
    else:
        cols.changes.touch_rows(layer, rows)
