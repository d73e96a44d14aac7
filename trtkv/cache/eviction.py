"""Eviction from pages no other sequence holds, as array operations over the victims.

``KVCacheManager.evict`` sends a request's victims here (all of one layer at once: a ThinKV anneal, an
H2O/R-KV event); pages shared by forked sequences, and evictions of a few tokens, go one by one
(``KVCacheManager._evict_each``). Both end in the same state (tests/test_cache_properties.py).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np
import torch

from trtkv.cache.columns import TableColumns
from trtkv.cache.forks import PageRefs
from trtkv.cache.pool import PagePool
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.sequence import SeqKV

DECREF_ARRAY_MIN = 64  # victims from which decref_groups uses array operations (numpy costs ~20 us a call)


def evict_private(pools: dict[str, PagePool], columns: TableColumns, layer: int, seq: SeqKV, positions,
                  reuse: bool = True) -> int:
    """Eviction from pages no other sequence holds, per format as array operations over the victims
    (the same end state as evicting them one by one, which ``KVCacheManager._evict_each`` does). ``reuse=False``:
    a compaction follows, the freed slots join no reuse heap."""
    return evict_private_many(pools, columns, layer, [(seq, positions)], reuse)[0]


def evict_one_by_one(pools: dict[str, PagePool], refs: PageRefs, seqs: Mapping[int, SeqKV], seq: SeqKV, layer: int,
                     positions: list[int]) -> int:
    """Eviction one token at a time from one layer (``pools``: its pools; ``seqs``: every sequence, by id): a
    forked sequence's pages may be shared (copy on write, or tree eviction in place; cache/forks.py)."""
    table = seq.layers[layer]
    table.forget(())  # an eviction hit this table (its live slots are no longer a prefix), victims or not
    n = 0
    for pos in positions:
        found = table.forget((pos,))
        if not found:
            continue
        fmt, p, s = found[0]
        pool = pools[fmt]
        if refs.sharers(layer, fmt, p):  # a page other sequences hold too
            if seq.fork_mode == "tree":
                refs.evict_shared(pool, seqs, seq, layer, fmt, p, s, int(pos))
                n += 1
                continue
            p = refs.make_private(pool, seq, layer, fmt, p)
        if pool.group_specs and pool.decref_group(int(pool.k_group[p, s])):
            seq.add_bytes(-pool.group_bytes)
        pool.mark_evicted(p, s)
        table.free_slot(pool, (fmt, int(pool.page_class[p])), p, s)
        n += 1
    return n


def evict_private_many(pools: dict[str, PagePool], columns: TableColumns, layer: int,
                       items: list[tuple[SeqKV, np.ndarray]], reuse: bool = True) -> list[int]:
    """``evict_private`` of several requests in one layer (``pools``: that layer's) — a batch's anneal: the
    position maps, one key-group read and one validity update per format for all of them; the reuse heaps and
    page releases request by request, in order, so the end state is that of evicting each in turn."""
    slot = {}  # a request listed twice (two segments annealed at once) is one request here, at its first place
    for seq, _ in items:
        slot.setdefault(id(seq), (len(slot), seq))
    seqs = [seq for _, seq in slot.values()]
    owner_of_item = np.fromiter((slot[id(seq)][0] for seq, _ in items), np.int64, len(items))
    rows = np.fromiter((seq.row for seq, _ in items), np.int64, len(items))
    item, fids, pages, slots = columns.forget_many(layer, rows, [np.asarray(p, np.int64).reshape(-1)
                                                                 for _, p in items])
    counts = np.bincount(item, minlength=len(items)).tolist()
    if not len(item):
        return counts
    owner = owner_of_item[item]
    order = np.argsort(owner, kind="stable")  # request by request, each in the order its victims were listed
    owner, fids, pages, slots = owner[order], fids[order], pages[order], slots[order]
    names = columns.fmt_names
    for f in sorted(np.unique(fids).tolist(), key=names.__getitem__):  # formats by name, as listed before
        fmt, pool = names[f], pools[names[f]]
        sel = fids == f
        o, p, sl = (owner, pages, slots) if sel.all() else (owner[sel], pages[sel], slots[sel])
        bounds = np.concatenate([[0], np.cumsum(np.bincount(o, minlength=len(seqs)))])
        gids = None
        if pool.group_specs:
            kg = pool.k_group
            gids = kg.numpy()[p, sl] if kg.device.type == "cpu" else \
                kg[torch.from_numpy(p).to(kg.device), torch.from_numpy(sl).to(kg.device)].cpu().numpy()
        pool.mark_evicted_many(p, sl)
        if gids is not None:
            decref_groups_many(seqs, pool, gids, bounds)
        pl, sll = p.tolist(), sl.tolist()
        for i, seq in enumerate(seqs):
            lo, hi = bounds[i], bounds[i + 1]
            if lo < hi:
                seq.layers[layer].free_slots(pool, fmt, pl[lo:hi], sll[lo:hi], reuse)
    return counts


def evict_one_each(pools: dict[str, PagePool], columns: TableColumns, layer: int, seqs: list[SeqKV],
                   rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Evict ``positions[i]`` (-1: nothing) of ``seqs[i]`` (distinct requests at ``rows`` of the columns, pages no
    other sequence holds) in one layer by array operations: a sliding window's or a scorer's one victim a step
    for the whole batch.
    The freed slot is kept in the columns outside the reuse heap (``TableColumns.single``) where the heap is
    empty, the page keeps live tokens and no slot is kept already; other victims join their heaps through
    ``BlockTable.free_slot``, request by request. Same end state as evicting each in turn. Returns the
    requests' rows and 1/0 a request (the caller counts the evictions)."""
    held, fids, pages, slots = columns.forget_rows(layer, rows, positions)
    idx = np.flatnonzero(held)
    slow: list[tuple[int, str, int, int, int]] = []
    names = columns.fmt_names
    for f in sorted(np.unique(fids).tolist(), key=names.__getitem__):  # formats by name, as listed before
        fmt = names[f]
        pool = pools[fmt]
        sel = np.flatnonzero(fids == f)
        pg, sl, who = pages[sel], slots[sel], idx[sel]
        gids = None
        if pool.group_specs:
            kg = pool.k_group
            gids = kg.numpy()[pg, sl] if kg.device.type == "cpu" else \
                kg[torch.from_numpy(pg).to(kg.device), torch.from_numpy(sl).to(kg.device)].cpu().numpy()
        pool.mark_evicted_distinct(pg, sl)  # one victim a request: distinct pages
        if gids is not None:
            decref_groups_many([seqs[i] for i in who.tolist()], pool, gids, np.arange(len(sel) + 1))
        classes = pool.page_class[pg]
        for c in np.unique(classes).tolist():
            cs = np.flatnonzero(classes == c)
            cls, r = (fmt, c), rows[who[cs]]
            keep = pool.live[pg[cs]] > 0  # (an emptied page goes back to the pool: free_slot's path)
            heaped, single = columns.reusable_rows(layer, r, cls), columns.singles(layer, r, cls)
            if heaped is not None:
                keep &= ~heaped
            if single is not None:
                keep &= single < 0
            columns.set_singles(layer, r[keep], cls, pg[cs[keep]] << 5 | sl[cs[keep]])
            slow += [(i, fmt, c, p, s) for i, p, s in zip(who[cs[~keep]].tolist(), pg[cs[~keep]].tolist(),
                                                          sl[cs[~keep]].tolist())]
    for i, fmt, c, p, s in sorted(slow):  # in request order: pages released as evicting in turn releases them
        seqs[i].layers[layer].free_slot(pools[fmt], (fmt, c), p, s)
    return rows, held.astype(np.int64)


def evict_one_each_layers(pools: PoolSet, columns: TableColumns, layers: np.ndarray, seqs: list[SeqKV],
                          rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``evict_one_each`` in each of ``layers`` (ascending, distinct) at once: ``positions [len(layers), n]`` (-1:
    nothing) of ``seqs`` (distinct, unforked requests at ``rows``), every format stacked (``PoolSet.stack``) and
    without a key-scale arena. Layer by layer, the same end state (layers share nothing). Returns the evictions
    of each request, summed over the layers."""
    layer, item, fids, pages, slots = columns.forget_rows_all(layers, rows, positions)
    slow: list[tuple[int, int, str, int, int, int]] = []
    names = columns.fmt_names
    for f in sorted(np.unique(fids).tolist(), key=names.__getitem__):
        fmt = names[f]
        stack = pools.stack(fmt)
        sel = np.flatnonzero(fids == f)
        li, who, pg, sl = layer[sel], item[sel], pages[sel], slots[sel]
        stack.mark_evicted_distinct(li, pg, sl)
        classes = stack.page_class[li, pg]
        for c in np.unique(classes).tolist():
            cs = np.flatnonzero(classes == c)
            cls, lc, r = (fmt, c), li[cs], rows[who[cs]]
            keep = (stack.live[lc, pg[cs]] > 0) & ~columns.reusable_at(lc, r, cls) & \
                (columns.singles_at(lc, r, cls) < 0)
            columns.set_singles_at(lc[keep], r[keep], cls, pg[cs[keep]] << 5 | sl[cs[keep]])
            out = cs[~keep]
            slow += zip(li[out].tolist(), who[out].tolist(), [fmt] * len(out), [c] * len(out), pg[out].tolist(),
                        sl[out].tolist())
    for lyr, i, fmt, c, p, s in sorted(slow):  # layer by layer, in request order (evict_one_each's order)
        seqs[i].layers[lyr].free_slot(pools.pool(lyr, fmt), (fmt, c), p, s)
    return np.bincount(item, minlength=len(seqs))


def decref_groups(seq: SeqKV, pool: PagePool, gids) -> None:
    """Drop one key-scale group reference per victim; groups freed in the order their last reference
    goes (what evicting one by one does, so the arena hands out the same ids afterwards)."""
    if len(gids) < DECREF_ARRAY_MIN:  # a page's slots (one or two groups): plain Python is cheaper
        gids = gids.tolist() if isinstance(gids, np.ndarray) else gids
        last = {g: i for i, g in enumerate(gids)}  # each group's last victim
        counts = Counter(gids)
        for g in sorted(last, key=last.__getitem__):
            if pool.decref_group(g, counts[g]):
                seq.add_bytes(-pool.group_bytes)
        return
    decref_groups_many([seq], pool, gids, np.array([0, len(gids)]))


def decref_groups_many(seqs: list[SeqKV], pool: PagePool, gids: np.ndarray, bounds: np.ndarray) -> None:
    """``decref_groups`` of several requests' victims at once (``gids[bounds[i]:bounds[i + 1]]`` are request
    ``i``'s). Key-scale groups are private to a request on this path, so freeing every group in the order of its
    last reference across the concatenation is what doing the requests in turn does."""
    gids = np.asarray(gids, np.int64)
    if len(gids) < DECREF_ARRAY_MIN:  # every request's share is small too: plain Python, request by request
        for i, seq in enumerate(seqs):
            if bounds[i] < bounds[i + 1]:
                decref_groups(seq, pool, gids[bounds[i]:bounds[i + 1]])
        return
    owner = np.repeat(np.arange(len(seqs)), np.diff(bounds))
    keep = gids >= 0  # slots without a group
    g, owner = gids[keep], owner[keep]
    if not len(g):
        return
    u, first_rev, counts = np.unique(g[::-1], return_index=True, return_counts=True)
    last = len(g) - 1 - first_rev
    order = np.argsort(last, kind="stable")  # by each group's last victim
    u, counts, last = u[order], counts[order], last[order]
    freed = pool.decref_groups_ordered(u, counts)
    for i, n in enumerate(np.bincount(owner[last[freed]], minlength=len(seqs)).tolist()):
        if n:
            seqs[i].add_bytes(-pool.group_bytes * n)
