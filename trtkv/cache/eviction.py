"""Eviction from pages no other sequence holds, as array operations over the victims.

``KVCacheManager.evict`` sends a request's victims here (all of one layer at once: a ThinKV anneal, an
H2O/R-KV event); pages shared by forked sequences, and evictions of a few tokens, go one by one
(``KVCacheManager._evict_each``). Both end in the same state (tests/test_cache_properties.py).
"""
from __future__ import annotations

import heapq
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from trtkv.cache.manager import KVCacheManager, SeqKV
    from trtkv.cache.pool import PagePool


def evict_private(mgr: KVCacheManager, seq: SeqKV, layer: int, positions: list[int]) -> int:
    """Eviction from pages no other sequence holds, per format as array operations over the victims
    (the same end state as evicting them one by one, which ``KVCacheManager._evict_each`` does)."""
    table = seq.layers[layer]
    table.holes = True
    loc, by_fmt = table.loc, {}
    for pos in positions:
        where = loc.pop(int(pos), None)
        if where is not None:
            by_fmt.setdefault(where[0], []).append(where)
    for fmt, items in by_fmt.items():
        pool = mgr.pools[layer][fmt]
        pages = np.fromiter((p for _, p, _ in items), np.int64, len(items))
        slots = np.fromiter((s for _, _, s in items), np.int64, len(items))
        if pool.group_specs:
            kg = pool.k_group
            gids = kg.numpy()[pages, slots] if kg.device.type == "cpu" else \
                kg[torch.from_numpy(pages).to(kg.device), torch.from_numpy(slots).to(kg.device)].cpu().numpy()
            decref_groups(seq, pool, gids.tolist())
        pool.mark_evicted_many(pages, slots)
        page_seq = table.page_seq
        for p, s, c in zip(pages.tolist(), slots.tolist(), pool.page_class[pages].tolist()):
            heapq.heappush(table.reusable.setdefault((fmt, c), []), (page_seq[(fmt, p)], p, s))
        for p in dict.fromkeys(pages.tolist()):
            cls = (fmt, int(pool.page_class[p]))
            if pool.live[p] == 0 and table.open_page.get(cls) != p:
                mgr._release(seq, table, pool, cls, p)
    return sum(len(items) for items in by_fmt.values())


def decref_groups(seq: SeqKV, pool: PagePool, gids: list[int]) -> None:
    """Drop one key-scale group reference per victim; groups freed in the order their last reference
    goes (what evicting one by one does, so the arena hands out the same ids afterwards)."""
    last = {g: i for i, g in enumerate(gids)}  # each group's last victim
    counts = Counter(gids)
    for g in sorted(last, key=last.__getitem__):
        if pool.decref_group(g, counts[g]):
            seq.add_bytes(-pool.group_bytes)
