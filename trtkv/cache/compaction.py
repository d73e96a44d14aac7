"""Gather compaction (R-KV and AMS style): after an eviction, move a request's live tokens of every class to
the front of its pages and release the emptied pages. It copies K/V codes; the in-place mode never does."""
from __future__ import annotations

import numpy as np

from trtkv.cache.forks import PageRefs
from trtkv.cache.pool import PagePool
from trtkv.cache.sequence import SeqKV


def compact(pools: dict[str, PagePool], refs: PageRefs, seq: SeqKV, layer: int) -> int:
    """Move every class's live tokens of ``seq`` in ``layer`` (``pools``: that layer's) to the front of its
    pages and free the rest; returns how many tokens' codes were copied."""
    table = seq.layers[layer]
    for cls, pages in list(table.pages.items()):  # gathering writes: shared pages are copied first
        for p in [p for p in pages if refs.sharers(layer, cls[0], p)]:
            refs.make_private(pools[cls[0]], seq, layer, cls[0], p)
    moved = 0
    for cls, pages in list(table.pages.items()):
        pool = pools[cls[0]]
        positions, dst_pages, dst_slots, n = pool.compact_pages(list(pages))
        moved += n
        table.place(cls[0], dst_pages, dst_slots, positions)
        table.compacted(pool, cls, -(-len(positions) // pool.B))
    table.forget_reusable()  # (a class left without pages may still list slots of the pages it gave back)
    return moved


def compact_many(pools: dict[str, PagePool], refs: PageRefs, seqs: list[SeqKV], layer: int) -> int:
    """``compact`` of each of ``seqs`` (distinct) in turn, the gathers of each format in one pass when no page
    anywhere is shared; the tables then take their tokens' new places and release their emptied pages in
    that same order, so the end state is the same."""
    if len(refs):
        return sum(compact(pools, refs, seq, layer) for seq in seqs)
    jobs = [(seq.layers[layer], cls, list(pages)) for seq in seqs
            for cls, pages in list(seq.layers[layer].pages.items())]
    placed: list = [None] * len(jobs)
    moved = 0
    for fmt in dict.fromkeys(cls[0] for _, cls, _ in jobs):
        idx = [j for j, (_, cls, _) in enumerate(jobs) if cls[0] == fmt]
        pos, dst_pages, dst_slots, counts, n = pools[fmt].compact_pages_many([jobs[j][2] for j in idx])
        moved += n
        cuts = np.cumsum(counts)[:-1]
        for j, p, dp, ds in zip(idx, np.split(pos, cuts), np.split(dst_pages, cuts), np.split(dst_slots, cuts)):
            placed[j] = (p, dp, ds)
    for (table, cls, _), (positions, dst_pages, dst_slots) in zip(jobs, placed):
        pool = pools[cls[0]]
        table.place(cls[0], dst_pages, dst_slots, positions)
        table.compacted(pool, cls, -(-len(positions) // pool.B))
    for seq in seqs:
        seq.layers[layer].forget_reusable()
    return moved
