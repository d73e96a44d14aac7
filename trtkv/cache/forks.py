"""Forked sequences that share pages: refcounts, sealing, copy-on-write and tree-wide eviction.

A child sequence references its parent's pages (never copied). Rules, all executed here so the rest of the
cache stays single-owner:

* **Sealing.** At a fork both sides drop their open page and their reusable slots: nobody ever writes
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

from collections.abc import Mapping

import torch

from trtkv.cache.block_table import held_page_bytes
from trtkv.cache.pool import PagePool
from trtkv.cache.sequence import SeqKV
from trtkv.errors import OutOfKVMemory

FORK_MODES = ("cow", "tree")


class PageRefs:
    """Sharers of pages referenced by more than one sequence: ``(layer, format, page) -> {seq ids}``, and the
    copies made on write."""

    def __init__(self) -> None:
        self._shared: dict[tuple[int, str, int], set[int]] = {}
        self.copies = 0  # pages copied because a sharer evicted from them

    def sharers(self, layer: int, fmt: str, p: int) -> set[int] | None:
        return self._shared.get((layer, fmt, p))

    def add(self, layer: int, fmt: str, p: int, *seq_ids: int) -> None:
        self._shared.setdefault((layer, fmt, p), set()).update(seq_ids)

    def drop(self, layer: int, fmt: str, p: int, seq_id: int) -> bool:
        """Remove one sharer; True when the page was shared (another sequence still holds it)."""
        key = (layer, fmt, p)
        s = self._shared.get(key)
        if s is None or seq_id not in s:
            return False
        s.discard(seq_id)
        if len(s) <= 1:
            del self._shared[key]
        return True

    def __len__(self) -> int:
        return len(self._shared)

    # --- verbs on shared pages -------------------------------------------------------------------
    def share(self, parent: SeqKV, child: SeqKV) -> None:
        """``child`` (new, empty) holds exactly ``parent``'s paged tokens, by reference; both are sealed."""
        for layer, (pt, ct) in enumerate(zip(parent.layers, child.layers)):
            pt.seal()
            ct.copy_from(pt)
            for (fmt, _), pages in pt.pages.items():
                for p in pages:
                    self.add(layer, fmt, p, parent.seq_id, child.seq_id)
        child.account.start_at(parent.kv_bytes)

    @torch.inference_mode()
    def make_private(self, pool: PagePool, seq: SeqKV, layer: int, fmt: str, p: int) -> int:
        """Copy-on-write: give ``seq`` its own copy of shared page ``p``; returns the copy's page id."""
        try:
            q = pool.copy_page(p)
        except OutOfKVMemory as e:
            raise e.at(seq.seq_id, layer, fmt) from None
        seq.layers[layer].replace_page((fmt, int(pool.page_class[p])), p, q, pool.slot_pos[q])
        self.drop(layer, fmt, p, seq.seq_id)
        self.copies += 1
        return q

    def evict_shared(self, pool: PagePool, seqs: Mapping[int, SeqKV], seq: SeqKV, layer: int, fmt: str, p: int,
                     s: int, pos: int) -> None:
        """Tree mode: evict slot ``s`` of shared page ``p`` for every sharer (``seq`` already forgot ``pos``)."""
        sharers = [seqs[i] for i in self.sharers(layer, fmt, p) if i in seqs]
        for other in sharers:
            if other is not seq and other.layers[layer].locate(pos) == (fmt, p, s):
                other.layers[layer].forget((pos,))
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
                    t.drop_page(pool, cls, p)
            del self._shared[(layer, fmt, p)]
            pool.release_page(p)

    def share_written(self, pools: dict[str, PagePool], owner: SeqKV, sharers: list[SeqKV], layer: int,
                      positions) -> None:
        """Make tokens just written into ``owner`` (a tree node rebuilt by rehydration) visible to ``sharers``
        (its live descendants), by reference: each page they lack joins their table. The owner is sealed."""
        otable = owner.layers[layer]
        otable.seal()
        for pos in positions:
            fmt, p, s = otable.locate(int(pos))
            pool = pools[fmt]
            cls = (fmt, int(pool.page_class[p]))
            for other in sharers:
                t = other.layers[layer]
                t.seal()
                t.place_one(fmt, p, s, int(pos))
                if t.add_shared_page(pool, cls, p):
                    self.add(layer, fmt, p, owner.seq_id, other.seq_id)

    def release(self, pool: PagePool, seq: SeqKV, layer: int, fmt: str, p: int) -> bool:
        """A freed sequence lets go of page ``p``: True when another sequence still holds it (only the
        reference and its bytes go)."""
        if not self.drop(layer, fmt, p, seq.seq_id):
            return False
        seq.add_bytes(-held_page_bytes(pool))
        return True

    def shared_bytes(self, pools, seq: SeqKV) -> int:
        """Bytes of the pages ``seq`` references that another live sequence references too."""
        total = 0
        for layer, table in enumerate(seq.layers):
            for (fmt, _), pages in table.pages.items():
                pool = pools[layer][fmt]
                total += sum(pool.page_bytes for p in pages if self.sharers(layer, fmt, p))
        return total
