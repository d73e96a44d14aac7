"""Gather compaction (R-KV and AMS style): after an eviction, move a request's live tokens of every class to
the front of its pages and release the emptied pages. It copies K/V codes; the in-place mode never does.

A batch whose tables hold one class a format is compacted from the batch's block tables (``compact_rows``): the
pages past each table's tokens leave its lists later (``LeavingPages``), as an eviction's emptied pages do, so an
event reads no table's Python lists."""
from __future__ import annotations

import numpy as np

from trtkv.cache.block_table import BlockTable
from trtkv.cache.columns import TableColumns
from trtkv.cache.forks import PageRefs
from trtkv.cache.pool import PagePool
from trtkv.cache.sequence import SeqKV


def compact(pools: dict[str, PagePool], refs: PageRefs, seq: SeqKV, layer: int) -> int:
    """Move every class's live tokens of ``seq`` in ``layer`` (``pools``: that layer's) to the front of its
    pages and free the rest; returns how many tokens' codes were copied."""
    return compact_many(pools, refs, [seq], layer)


def compact_many(pools: dict[str, PagePool], refs: PageRefs, seqs: list[SeqKV], layer: int) -> int:
    """``compact`` of each of ``seqs`` (distinct) in turn, the gathers of each format in one pass (one request at
    a time when pages are shared); the tables then take their tokens' new places and release their emptied
    pages in that same order, so the end state is the same."""
    if len(refs) and len(seqs) > 1:
        return sum(compact_many(pools, refs, [seq], layer) for seq in seqs)
    if len(refs):  # gathering writes: shared pages are copied first
        table = seqs[0].layers[layer]
        for cls, pages in list(table.pages.items()):
            for p in [p for p in pages if refs.sharers(layer, cls[0], p)]:
                refs.make_private(pools[cls[0]], seqs[0], layer, cls[0], p)
    BlockTable.catch_up_each([seq.layers[layer] for seq in seqs])
    # (the tables' own lists: read by the gathers below before any table cuts its own)
    jobs = [(table, cls, pages) for table in (seq.layers[layer] for seq in seqs) for cls, pages in table.pages.items()]
    moved = 0
    for fmt in dict.fromkeys(cls[0] for _, cls, _ in jobs):
        mine = [job for job in jobs if job[1][0] == fmt]
        pos, dst_pages, dst_slots, counts, n = pools[fmt].compact_pages_many([pages for _, _, pages in mine])
        moved += n
        BlockTable.compacted_each(pools[fmt], fmt, [(table, cls) for table, cls, _ in mine], pos, dst_pages,
                                  dst_slots, counts)
    # (a class left without pages may still list slots of the pages it gave back)
    BlockTable.forget_reusable_each([seq.layers[layer] for seq in seqs])
    return moved


def compact_rows(pools: dict[str, PagePool], columns: TableColumns, seqs: list[SeqKV], rows: np.ndarray, layer: int,
                 tables: dict[str, tuple[np.ndarray, np.ndarray]]) -> int | None:
    """``compact_many`` of ``seqs`` (distinct, no shared pages; rows ``rows`` of ``columns``) from their pages in
    ``layer`` as the batch's block tables hold them (``tables``: format -> ``(pages [b, width], counts [b])``, each row
    in its table's order): the same end state, the cut pages leaving the tables' lists later. None (nothing done)
    when a table holds pages of several classes of a format."""
    jobs = []
    for fmt, (pages, lens) in tables.items():
        at = np.flatnonzero(lens)
        if not len(at):
            continue
        held = np.arange(pages.shape[1]) < lens[at, None]
        pg = pages[at][held].astype(np.int64)  # (row-major: table after table, each in its order)
        classes = pools[fmt].page_class[pg]
        first = np.repeat(np.cumsum(lens[at]) - lens[at], lens[at])
        if (classes != classes[first]).any():
            return None
        jobs.append((fmt, at, pg, classes[np.cumsum(lens[at]) - lens[at]]))
    moved = 0
    for fmt, at, pg, cls in jobs:
        pool, n = pools[fmt], tables[fmt][1][at]
        pos, dst_pages, dst_slots, counts, copied = pool.compact_pages_flat(pg, n)
        moved += copied
        columns.place_each(layer, np.repeat(rows[at], counts), fmt, dst_pages, dst_slots, pos)
        keep = -(-counts // pool.B)
        start = np.cumsum(n) - n
        cut = n - keep
        if cut.any():  # the pages past each table's tokens (empty now) go back, leaving its lists later
            gone = pg[np.repeat(start + keep, cut) + np.arange(int(cut.sum())) - np.repeat(np.cumsum(cut) - cut, cut)]
            j = np.flatnonzero(cut)
            BlockTable.release_each(pool, lambda i: seqs[i].layers[layer], at[j], rows[at[j]], cls[j], gone, cut[j])
        last = np.where(keep > 0, pg[start + keep - 1], -1)
        last[last >= 0] = np.where(pool.hwm[last[last >= 0]] < pool.B, last[last >= 0], -1)  # (a full page closes)
        for c in np.unique(cls).tolist():
            mine = cls == c
            columns.set_opens(layer, rows[at[mine]], (fmt, c), last[mine])
    columns.reuse.clear(layer, rows)  # (nothing reusable: every class's tokens were gathered)
    return moved
