"""Forked sequences that share pages: refcounts, sealing, copy-on-write and tree-wide eviction.

A child sequence references its parent's pages (never copied). Rules, all executed here so the rest of the
cache stays single-owner:

* **Sealing.** At a fork both sides drop their open page and their reusable-slot heaps: nobody ever writes
  into a shared page. The child starts its own tokens on a *new* page, so a partly filled last page stays
  shared with its unused tail (at most one such page per fork and layer; nothing is copied).
* **Sharers.** ``PageRefs`` records, for every page referenced by two or more sequences, their ids. A page
  is returned to its pool only when its last sharer lets go (freeing a parent before its children keeps
  the shared pages alive).
* **Copy-on-write** (``mode="cow"``, independent samples such as ``SamplingParams(n=K)``). Validity bits live
  in the pool, per page, so in-place eviction in a shared page would hide the token from every sharer: the
  evicting sequence first copies the page (codes, scales, metadata) and evicts in its private copy.
* **Tree-wide eviction** (``mode="tree"``, tree search). A shared page is one node's KV; evicting a token
  from it removes it for every sharer (all of them are that node's descendants), the page's bits flip once,
  and when the page empties it leaves every sharer's table.
* **Bytes.** A sequence's ``kv_bytes`` counts every page it references (its view, as if alone);
  ``KVCacheManager.engine_bytes`` counts each physical page once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from trtkv.errors import OutOfKVMemory

if TYPE_CHECKING:
    from trtkv.cache.manager import KVCacheManager, SeqKV

FORK_MODES = ("cow", "tree")


class PageRefs:
    """Sharers of pages referenced by more than one sequence: ``(layer, format, page) -> {seq ids}``."""

    def __init__(self) -> None:
        self.shared: dict[tuple[int, str, int], set[int]] = {}

    def sharers(self, layer: int, fmt: str, p: int) -> set[int] | None:
        return self.shared.get((layer, fmt, p))

    def add(self, layer: int, fmt: str, p: int, *seq_ids: int) -> None:
        self.shared.setdefault((layer, fmt, p), set()).update(seq_ids)

    def drop(self, layer: int, fmt: str, p: int, seq_id: int) -> bool:
        """Remove one sharer; True when the page was shared (another sequence still holds it)."""
        key = (layer, fmt, p)
        s = self.shared.get(key)
        if s is None or seq_id not in s:
            return False
        s.discard(seq_id)
        if len(s) <= 1:
            del self.shared[key]
        return True

    def __len__(self) -> int:
        return len(self.shared)


def _seal(table) -> None:
    """No more writes into the table's current pages; its tokens are no longer one dense run (a sealed
    partly filled page leaves unwritten slots), so attention must not take the dense-view fast path."""
    table.open_page.clear()
    table.reusable.clear()
    table.holes = True


def seal_sequence(seq: SeqKV) -> None:
    """A sequence that will write no more tokens of its own (a closed tree node): its pages are released as
    soon as evictions empty them (an open page would otherwise stay held)."""
    for table in seq.layers:
        _seal(table)


@torch.inference_mode()
def fork_sequence(mgr: KVCacheManager, parent: SeqKV, child_id: int, mode: str = "cow") -> SeqKV:
    """A new sequence holding exactly the parent's tokens, by reference."""
    if mode not in FORK_MODES:
        raise ValueError(f"fork mode must be one of {FORK_MODES}")
    child = mgr.add_sequence(child_id)
    child.fork_mode = parent.fork_mode = mode
    if parent.buf_k is not None:  # the residual buffer (<= g tokens) is copied: it is not paged
        child.buf_k.copy_(parent.buf_k)
        child.buf_v.copy_(parent.buf_v)
        child.buf_pos = [list(p) for p in parent.buf_pos]
    for layer, (pt, ct) in enumerate(zip(parent.layers, child.layers)):
        _seal(pt)
        ct.pages = {cls: list(pages) for cls, pages in pt.pages.items()}
        ct.page_seq = dict(pt.page_seq)
        ct.loc = dict(pt.loc)
        ct.holes = True
        for (fmt, _), pages in pt.pages.items():
            for p in pages:
                mgr.refs.add(layer, fmt, p, parent.seq_id, child_id)
    child.kv_bytes = child.peak_bytes = parent.kv_bytes
    return child


@torch.inference_mode()
def make_private(mgr: KVCacheManager, seq: SeqKV, layer: int, fmt: str, p: int) -> int:
    """Copy-on-write: give ``seq`` its own copy of shared page ``p``; returns the copy's page id."""
    table = seq.layers[layer]
    pool = mgr.pools[layer][fmt]
    cls = (fmt, int(pool.page_class[p]))
    try:
        q = pool.alloc_page(cls[1])
    except OutOfKVMemory as e:
        raise e.at(seq.seq_id, layer, fmt) from None
    for t in pool.fields:
        t[q] = t[p]
    pool.k_group[q] = pool.k_group[p]
    pool.valid[q], pool.live[q], pool.hwm[q] = pool.valid[p], pool.live[p], pool.hwm[p]
    pool.slot_pos[q], pool.slot_seg[q] = pool.slot_pos[p], pool.slot_seg[p]
    if pool.group_specs:  # the copy's slots point at the same key-scale groups
        for s in range(pool.B):
            if pool.valid[q] >> s & 1:
                g = int(pool.k_group[q, s])
                if g >= 0:
                    pool.group_ref[g] += 1
    pages = table.pages[cls]
    pages[pages.index(p)] = q
    mgr._page_counter += 1
    del table.page_seq[(fmt, p)]
    table.page_seq[(fmt, q)] = mgr._page_counter
    for s in range(pool.B):
        pos = int(pool.slot_pos[q, s])
        if pos >= 0 and table.loc.get(pos) == (fmt, p, s):
            table.loc[pos] = (fmt, q, s)
    table._flat = table._bt = None
    mgr.refs.drop(layer, fmt, p, seq.seq_id)
    mgr.cow_copies += 1
    return q


def evict_shared(mgr: KVCacheManager, seq: SeqKV, layer: int, fmt: str, p: int, s: int, pos: int) -> None:
    """Tree mode: evict slot ``s`` of shared page ``p`` for every sharer (the caller popped ``seq``'s loc)."""
    pool = mgr.pools[layer][fmt]
    sharers = [mgr.seqs[i] for i in mgr.refs.sharers(layer, fmt, p) if i in mgr.seqs]
    for other in sharers:
        if other is not seq and other.layers[layer].loc.get(pos) == (fmt, p, s):
            del other.layers[layer].loc[pos]
            other.layers[layer].holes = True
    g = int(pool.k_group[p, s]) if pool.group_specs else -1
    if pool.decref_group(g):
        for other in sharers:
            other.add_bytes(-pool.group_bytes)
    pool.mark_evicted(p, s)
    if pool.live[p] == 0:
        cls = (fmt, int(pool.page_class[p]))
        for other in sharers:
            t = other.layers[layer]
            if p in t.pages.get(cls, ()):
                t.pages[cls].remove(p)
                t.page_seq.pop((fmt, p), None)
                t._flat = t._bt = None
                other.add_bytes(-(pool.page_bytes + 4))
        del mgr.refs.shared[(layer, fmt, p)]
        pool.release_page(p)


def share_written(mgr: KVCacheManager, owner: SeqKV, sharers: list[SeqKV], layer: int, positions) -> None:
    """Make tokens just written into ``owner`` (a tree node rebuilt by rehydration) visible to ``sharers``
    (its live descendants), by reference: each page they lack joins their table. The owner is sealed."""
    otable = owner.layers[layer]
    _seal(otable)
    for pos in positions:
        fmt, p, s = otable.loc[int(pos)]
        pool = mgr.pools[layer][fmt]
        cls = (fmt, int(pool.page_class[p]))
        for other in sharers:
            t = other.layers[layer]
            _seal(t)
            t.loc[int(pos)] = (fmt, p, s)
            if (fmt, p) not in t.page_seq:
                t.pages.setdefault(cls, []).append(p)
                t.page_seq[(fmt, p)] = otable.page_seq[(fmt, p)]
                t._flat = t._bt = None
                other.add_bytes(pool.page_bytes + 4)
                mgr.refs.add(layer, fmt, p, owner.seq_id, other.seq_id)


def release_sequence_page(mgr: KVCacheManager, seq: SeqKV, layer: int, fmt: str, p: int) -> bool:
    """``free_sequence`` of one page: True when another sequence still holds it (only the reference goes)."""
    if not mgr.refs.drop(layer, fmt, p, seq.seq_id):
        return False
    pool = mgr.pools[layer][fmt]
    seq.add_bytes(-(pool.page_bytes + 4))
    return True


def shared_bytes(mgr: KVCacheManager, seq: SeqKV) -> int:
    """Bytes of the pages ``seq`` references that another live sequence references too."""
    total = 0
    for layer, table in enumerate(seq.layers):
        for (fmt, _), pages in table.pages.items():
            pool = mgr.pools[layer][fmt]
            total += sum(pool.page_bytes for p in pages if mgr.refs.sharers(layer, fmt, p))
    return total


def live_slots(mgr: KVCacheManager, layer: int = 0) -> int:
    """Tokens one layer holds in pages across the engine, each physical slot once."""
    return int(sum(int(np.sum(pool.live)) for pool in mgr.pools[layer].values()))
