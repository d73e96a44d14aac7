"""Several finished requests' pages and key-scale groups back to their pools at once.

A batch that finishes together (a memory-limited run's requests all reach their length on one step) would
otherwise return its pages request by request, one call per layer, format and request (``free_sequence`` is
this with one request). Here each layer's pool of
each format takes every request's pages in one call: the pages join the pool's free heap (a set: the order of
release does not matter), and the key-scale groups lose their references in the order freeing the requests in
turn would drop them (``decref_groups_many``), so the arenas hand out the same ids afterwards.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from trtkv.cache.block_table import held_page_bytes
from trtkv.cache.eviction import decref_groups_many
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.sequence import SeqKV


def release_tables(pools: PoolSet, seqs: list[SeqKV], held_of: Callable | None = None) -> None:
    """Every page of ``seqs`` back to its pool, one call per (layer, format). ``held_of(seq, layer, fmt, pages)``:
    the pages that go (forks: the ones no other sequence still holds); default all of them."""
    for layer in range(len(seqs[0].layers) if seqs else 0):
        by_cls: dict = {}
        for seq in seqs:
            for cls, pages in list(seq.layers[layer].pages.items()):
                if held_of is not None:
                    pages = held_of(seq, layer, cls[0], pages)
                by_cls.setdefault(cls, []).append((seq, pages))
        for cls, items in by_cls.items():
            pool = pools[layer][cls[0]]
            lens = np.fromiter((len(pages) for _, pages in items), np.int64, len(items))
            held = np.fromiter(itertools.chain.from_iterable(pages for _, pages in items), np.int64, int(lens.sum()))
            owners = [seq for seq, _ in items]
            if pool.group_specs:  # one reference drop per live slot, in page then slot order, request by request
                gids = pool.key_groups(*pool.live_slots(held))
                per = np.bincount(np.repeat(np.arange(len(items)), lens), weights=pool.live[held],
                                  minlength=len(items)).astype(np.int64)
                decref_groups_many(owners, pool, gids, np.concatenate([[0], np.cumsum(per)]))
            pool.clear_page(held)
            pool.release_pages(held)
            cost = held_page_bytes(pool)
            for seq, n in zip(owners, lens.tolist()):
                seq.add_bytes(-cost * n)
