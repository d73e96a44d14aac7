"""Gather compaction (R-KV and AMS style): after an eviction, move a request's live tokens of every class to
the front of its pages and release the emptied pages. It copies K/V codes; the in-place mode never does."""
from __future__ import annotations

from trtkv.cache.block_table import BlockTable
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
