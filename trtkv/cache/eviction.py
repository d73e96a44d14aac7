"""Eviction from pages no other sequence holds, as array operations over the victims.

``KVCacheManager.evict`` sends a request's victims here (all of one layer at once: a ThinKV anneal, an
H2O/R-KV event); pages shared by forked sequences, and evictions of a few tokens, go one by one
(``KVCacheManager._evict_each``). Both end in the same state (tests/test_cache_properties.py).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np

from trtkv.cache.accounting import ByteAccount
from trtkv.cache.block_table import BlockTable
from trtkv.cache.columns import TableColumns
from trtkv.cache.forks import PageRefs
from trtkv.cache.pool import PagePool
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.pool_stack import flat
from trtkv.cache.sequence import SeqKV

DECREF_ARRAY_MIN = 64  # victims from which decref_groups uses array operations (numpy costs ~20 us a call)


def evict_private(pools: dict[str, PagePool], columns: TableColumns, layer: int, seq: SeqKV, positions,
                  reuse: bool = True) -> int:
    """Eviction from pages no other sequence holds, per format as array operations over the victims
    (the same end state as evicting them one by one, which ``KVCacheManager._evict_each`` does). ``reuse=False``:
    a compaction follows, the freed slots are not made reusable."""
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
    """``evict_private`` of several requests in one layer (``pools``: that layer's) — a batch's event: the
    position maps, one key-group read, one validity update and one addition of reusable slots per format for all
    of them; emptied pages go back request by request, in order, so the end state is that of evicting each in
    turn."""
    positions = [np.asarray(p, np.int64).reshape(-1) for _, p in items]
    lens = np.fromiter(map(len, positions), np.int64, len(positions))
    flat_positions = np.concatenate(positions) if positions else np.empty(0, np.int64)
    return evict_private_flat(pools, columns, layer, [seq for seq, _ in items], flat_positions, lens, reuse)


def evict_private_flat(pools: dict[str, PagePool], columns: TableColumns, layer: int, item_seqs: list[SeqKV],
                       positions: np.ndarray, lens: np.ndarray, reuse: bool = True) -> list[int]:
    """``evict_private_many`` with the victims concatenated: ``lens[i]`` of ``positions`` are item ``i``'s, of
    ``item_seqs[i]``. Returns each item's count."""
    n_items = len(item_seqs)
    rows = np.fromiter((seq.row for seq in item_seqs), np.int64, n_items)
    # a request listed twice (two segments annealed at once) is one request here, at its first place
    _, first, same = np.unique(rows, return_index=True, return_inverse=True)
    place = np.empty(len(first), np.int64)
    place[np.argsort(first, kind="stable")] = np.arange(len(first))
    owner_of_item = place[same.reshape(-1)]
    seqs = [item_seqs[i] for i in np.sort(first).tolist()]
    item, fids, pages, slots = columns.forget_flat(layer, rows, np.repeat(np.arange(n_items), lens),
                                                   np.asarray(positions, np.int64))
    counts = np.bincount(item, minlength=n_items).tolist()
    if not len(item):
        return counts
    owner = owner_of_item[item]
    order = np.argsort(owner, kind="stable")  # request by request, each in the order its victims were listed
    owner, fids, pages, slots, item = owner[order], fids[order], pages[order], slots[order], item[order]
    seq_rows = np.fromiter((seq.row for seq in seqs), np.int64, len(seqs))
    names = columns.fmt_names
    for f in sorted(np.unique(fids).tolist(), key=names.__getitem__):  # formats by name, as listed before
        fmt, pool = names[f], pools[names[f]]
        sel = fids == f
        o, p, sl = (owner, pages, slots) if sel.all() else (owner[sel], pages[sel], slots[sel])
        gids = pool.key_groups(p, sl) if pool.group_specs else None
        pool.mark_evicted_many(p, sl)
        if gids is not None:  # in job order: a request listed twice frees a group at its last job, as in turn
            back = np.argsort(order if sel.all() else order[sel], kind="stable")
            jobs = (item if sel.all() else item[sel])[back]
            decref_groups_many(item_seqs, pool, gids[back],
                               np.concatenate([[0], np.cumsum(np.bincount(jobs, minlength=n_items))]))
        _free_slots(pool, columns, layer, fmt, seq_rows[o], p, sl, reuse,
                    lambda first, cls, gone, counts, o=o, pool=pool: BlockTable.release_each(
                        pool, lambda i: seqs[i].layers[layer], o[first], seq_rows[o[first]], cls, gone, counts))
    return counts


ReleaseJobs = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]  # (first, classes, pages, counts)


def _free_slots(pool: PagePool, columns: TableColumns, layer, fmt: str, rows: np.ndarray, pages: np.ndarray,
                slots: np.ndarray, reuse: bool, release: ReleaseJobs) -> None:
    """Slots just evicted (slot ``slots[i]`` of page ``pages[i]``, row ``rows[i]`` in ``layer``, an int or an
    array) become reusable by their rows (``reuse``); a page left empty that is not its class's open page goes
    back to the pool, taking its slots with it: one ``release(first, classes, pages, counts)`` with a job for each
    table and class (``first[j]``: the job's first victim, ``counts[j]`` of ``pages`` its emptied pages, jobs and
    their pages in victim order: the pool's free pages end the same as releasing each page in turn)."""
    one_layer = np.ndim(layer) == 0  # (a layer's PagePool; else a SlotStack and each victim's layer)
    at_page = pages if one_layer else layer * pool.live.shape[1] + pages  # (flat indices: pool_stack.flat)
    classes, empty = flat(pool.page_class)[at_page], flat(pool.live)[at_page] == 0

    def layers_of(idx: np.ndarray):
        return layer if one_layer else layer[idx]

    one = len(classes) and classes.min() == classes.max()  # (one class: no selection)
    for c in [int(classes[0])] if one else np.unique(classes).tolist():
        at = slice(None) if one else np.flatnonzero(classes == c)
        gone = empty[at] & (columns.open_pages(layer if one else layers_of(at), rows[at], (fmt, c)) != pages[at])
        empty[at] = gone
        if reuse:
            keep = np.flatnonzero(~gone) if one else at[~gone]
            columns.reuse.push(layers_of(keep), rows[keep], (fmt, c), pages[keep], slots[keep])
    rel = np.flatnonzero(empty)
    if not len(rel):
        return
    li = np.zeros(len(rel), np.int64) if one_layer else layer[rel]
    # each emptied page at its first victim, in victim order (a private page is one row's: the flat page is the key)
    _, first = np.unique(at_page[rel], return_index=True)
    first.sort()
    at = rel[first]
    # a table's emptied pages of a class form one job; jobs in the order of their first page, pages in victim order
    c = classes[at] - int(classes[at].min())
    r = rows[at]
    job_key = (li[first] * (int(r.max()) + 1) + r) * (int(c.max()) + 1) + c
    _, job_first, job_of = np.unique(job_key, return_index=True, return_inverse=True)
    rank = np.empty(len(job_first), np.int64)
    rank[np.argsort(job_first, kind="stable")] = np.arange(len(job_first))
    job_of = rank[job_of.reshape(-1)]
    job_first = np.sort(job_first)
    release(at[job_first], classes[at[job_first]], pages[at][np.argsort(job_of, kind="stable")],
            np.bincount(job_of, minlength=len(job_first)))


def evict_one_each(pools: dict[str, PagePool], columns: TableColumns, layer: int, seqs: list[SeqKV],
                   rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Evict ``positions[i]`` (-1: nothing) of ``seqs[i]`` (distinct requests at ``rows`` of the columns, pages no
    other sequence holds) in one layer by array operations: a sliding window's or a scorer's one victim a step
    for the whole batch. Same end state as evicting each in turn. Returns the requests' rows and 1/0 a request
    (the caller counts the evictions)."""
    held, fids, pages, slots = columns.forget_rows(layer, rows, positions)
    idx = np.flatnonzero(held)
    names = columns.fmt_names
    for f in sorted(np.unique(fids).tolist(), key=names.__getitem__):  # formats by name, as listed before
        fmt = names[f]
        pool = pools[fmt]
        sel = np.flatnonzero(fids == f)
        pg, sl, who = pages[sel], slots[sel], idx[sel]
        gids = pool.key_groups(pg, sl) if pool.group_specs else None
        pool.mark_evicted_distinct(pg, sl)  # one victim a request: distinct pages
        if gids is not None:
            decref_groups_many([seqs[i] for i in who.tolist()], pool, gids, np.arange(len(sel) + 1))
        _free_slots(pool, columns, layer, fmt, rows[who], pg, sl, True,
                    lambda first, cls, gone, counts, who=who, pool=pool: BlockTable.release_each(
                        pool, lambda i: seqs[i].layers[layer], who[first], rows[who[first]], cls, gone, counts))
    return rows, held.astype(np.int64)


def evict_rows_layers(pools: PoolSet, columns: TableColumns, layers: np.ndarray, seqs: list[SeqKV], rows: np.ndarray,
                      positions: np.ndarray) -> np.ndarray:
    """``evict_private`` of each of ``seqs`` (distinct, unforked requests at ``rows``) in each of ``layers``
    (ascending, distinct) at once: ``positions [len(layers), n]`` (one victim a request) or ``[len(layers), n, m]``
    (distinct within a request; -1: nothing), every format stacked (``PoolSet.stack``) and without a key-scale arena.
    Layer by layer, the same end state (layers share nothing). Returns the evictions of each request, summed over
    the layers."""
    layer, item, fids, pages, slots = columns.forget_rows_all(layers, rows, positions)
    names = columns.fmt_names
    freed = np.zeros(len(seqs), np.int64)  # bytes of each request's emptied pages, over every layer
    one = len(fids) and fids.min() == fids.max()  # (one format: no selection)
    for f in [int(fids[0])] if one else sorted(np.unique(fids).tolist(), key=names.__getitem__):
        fmt = names[f]
        stack = pools.stack(fmt)
        if one:
            li, who, pg, sl = layer, item, pages, slots
        else:
            sel = np.flatnonzero(fids == f)
            li, who, pg, sl = layer[sel], item[sel], pages[sel], slots[sel]
        if positions.ndim == 2:
            stack.mark_evicted_distinct(li, pg, sl)  # (one slot a request and layer: pages distinct in a layer)
        else:
            stack.mark_evicted_many(li, pg, sl)

        def release(first, cls, gone, counts, who=who, li=li, fmt=fmt):  # each layer's tables, with its pool
            job_layer = li[first]
            for at in dict.fromkeys(job_layer.tolist()):
                mine = job_layer == at
                owners = who[first[mine]]
                BlockTable.release_each(pools.pool(at, fmt), lambda i, at=at: seqs[i].layers[at], owners, rows[owners],
                                        cls[mine], gone[np.repeat(mine, counts)], counts[mine], freed)

        _free_slots(stack, columns, li, fmt, rows[who], pg, sl, True, release)
    for i in np.flatnonzero(freed).tolist():  # (a request's bytes only fall here: its peak cannot move)
        seqs[i].add_bytes(-int(freed[i]))
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
    n = np.bincount(owner[last[freed]], minlength=len(seqs))
    at = np.flatnonzero(n)
    ByteAccount.add_each([seqs[i].account for i in at.tolist()], (-pool.group_bytes * n[at]).tolist())
