"""Gather compaction (R-KV and AMS style): after an eviction, move a request's live tokens of every class to
the front of its pages and release the emptied pages. It copies K/V codes; the in-place mode never does."""
from __future__ import annotations

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
    return moved
