"""The paged KV cache: per-layer page pools per format, per-request block tables, residual buffers.

A policy *decides* which token positions to evict and which format/thought a flush group gets; this
manager *executes*: it allocates slots (reusing evicted slots of the same class in place — ThinKV's
Continuous Thinking — before touching tail capacity or new pages), writes through the ``kv_write``
plugin, flips validity bits on eviction (metadata only), or compacts by gather when configured to,
and accounts every byte it holds.

Ownership, top down: ``KVCacheManager`` (requests, writes, evictions; its reads in ``CacheReads``,
``trtkv/cache/manager_reads.py``) → ``SeqKV`` (one request:
a ``BlockTable`` per layer, its ``ResidualBuffer``, its ``ByteAccount``) → ``PoolSet`` → ``PagePool``
(pages of one format in one layer). ``PageRefs`` owns what forked sequences share.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
import torch

from plugins.formats import LayerScales
from plugins import ops as plugin_ops  # the ops' entry points; see plugins/ops.py
from trtkv.cache import compaction, reads
from trtkv.cache.accounting import ByteAccount
from trtkv.cache.batch_alloc import alloc_one_each, alloc_slots_each
from trtkv.cache.block_table import Cls
from trtkv.cache.budget import PoolPlan
from trtkv.cache.columns import TableColumns
from trtkv.cache.config import CACHE_SETTINGS, EVICTION_MODES, MAX_BLOCK_SIZE, CacheConfig  # noqa: F401 (re-exported)
from trtkv.cache.eviction import (evict_one_by_one, evict_one_each,
                                  evict_rows_layers, evict_private, evict_private_flat, evict_private_many)
from trtkv.cache.flush import FlushPlan, flush_many, plan_flush
from trtkv.cache.forks import FORK_MODES, PageRefs
from trtkv.cache.index_ops import split_counts
from trtkv.cache.manager_reads import CacheReads
from trtkv.cache.pool import PagePool
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.release import release_tables
from trtkv.cache.residual import ResidualArena
from trtkv.cache.sequence import SeqKV
from trtkv.cache.write_plan import WritePlan, plan_each_layer, plan_write_through

EVICT_BATCH_MIN = 8  # evictions of fewer tokens go one by one (same end state; see KVCacheManager.evict)

__all__ = ["KVCacheManager", "SeqKV", "Cls", "CacheConfig", "CACHE_SETTINGS", "fp16_bytes_per_token"]


class KVCacheManager(CacheReads):
    """``formats``: every format the cache will store (the policy's ``pool_formats()``), so ``kv_memory``
    can be split among them; ``drops_tokens``: whether the policy may drop tokens (sizes the key-scale
    arenas, see ``trtkv/cache/budget.py``); ``useful_pages``: the most pages a pool could ever hold (caps the
    default budget). The pools are sized and allocated once, on first use. ``pools``: a ``PoolSet`` of its
    own instead (the host tiers' growing pools, ``trtkv/cache/tiers.py``)."""

    def __init__(self, cfg: CacheConfig, kv_amax: dict | None = None, formats=None, drops_tokens: bool = True,
                 useful_pages: int | None = None, pools: PoolSet | None = None):
        self.cfg = cfg
        self.kv_amax = kv_amax
        self.pools = pools if pools is not None else PoolSet(cfg, kv_amax, formats, drops_tokens, useful_pages)
        self.seqs: dict[int, SeqKV] = {}
        self._page_order = itertools.count(1)  # pages numbered as tables take them: "oldest page first"
        self.columns = TableColumns(cfg.num_layers)  # every request's position maps, open pages, ... (by row)
        self._rows_of: tuple[list | None, np.ndarray] = (None, np.empty(0, np.int64))  # last batch's rows
        self._positions_of: tuple[list | None, np.ndarray] = (None, np.empty(0, np.int64))
        self._residual_rows_of: tuple[list | None, np.ndarray] = (None, np.empty(0, np.int64))
        self._residual_distinct = True  # whether those rows are distinct
        self._batch_tables = reads.BlockTableCache(cfg.num_layers)
        self.evictions_total = 0
        self.compaction_moves = 0  # tokens copied by gather compaction
        self._tiers = None
        self.refs = PageRefs()  # pages shared by forked sequences (cache/forks.py)
        self.clock = None  # the engine's decode-step profile clock (runtime/observers.py::PhaseClock), if any
        self.residual = ResidualArena(cfg) if cfg.residual_group > 1 else None  # every request's residual buffer

    @property
    def tiers(self):
        """The host tiers of this cache (T1/T2; ``trtkv.cache.tiers.TierStore``), created on first use."""
        if self._tiers is None:
            from trtkv.cache.tiers import TierStore

            self._tiers = TierStore(self)
        return self._tiers

    @property
    def has_tiers(self) -> bool:
        """Whether the host tiers exist (asking ``tiers`` creates them)."""
        return self._tiers is not None

    def evictions_stay_in_layer(self, seqs: list[SeqKV]) -> bool:
        """Whether evicting from ``seqs`` in one layer leaves every other layer's slots, pages and the page
        numbering as they were: in-place eviction, no host tier, no forked sequence (whose copies take pages)."""
        return (self.cfg.eviction != "compact" and self.cfg.demote == "none" and not self.has_tiers
                and all(s.fork_mode is None for s in seqs))

    @property
    def cow_copies(self) -> int:
        """Pages copied because a sharer evicted from them."""
        return self.refs.copies

    # --- requests ---------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> SeqKV:
        buf = self.residual.acquire() if self.residual is not None else None
        seq = SeqKV(seq_id, self.cfg.num_layers, self._page_order, self.columns, self.columns.acquire(), buf)
        self.seqs[seq_id] = seq
        return seq

    def free_sequence(self, seq_id: int) -> None:
        """Return every page and key-scale group of the request to the pools, at once."""
        self.free_sequences([seq_id])

    def free_sequences(self, seq_ids: list[int]) -> None:
        """``free_sequence`` of several requests at once (a batch finishing together): each layer's pool of each
        format takes back all their pages and key-scale groups in one call (``cache/release.py``) — the same
        pools, arenas and accounts as freeing them in turn. With shared pages (forks) each goes in turn."""
        seqs = [self.seqs.pop(i) for i in seq_ids]
        for seq in seqs:
            if seq.residual is not None:
                self.residual.release(seq.residual)
            if self._tiers is not None:  # the request's host-tier pages go too
                self._tiers.free(seq.seq_id)
        if len(self.refs):
            for seq in seqs:  # a page another sequence still holds loses only this reference (and its bytes)
                release_tables(self.pools, [seq], lambda s, layer, fmt, pages: [
                    p for p in pages if not self.refs.release(self.pools[layer][fmt], s, layer, fmt, p)])
        else:
            release_tables(self.pools, seqs)
        for seq in seqs:
            self.columns.release(seq.row)

    def fork(self, parent: SeqKV, child_id: int, mode: str = "cow") -> SeqKV:
        """A new sequence holding exactly the parent's tokens, by reference (``cache/forks.py``)."""
        if mode not in FORK_MODES:
            raise ValueError(f"fork mode must be one of {FORK_MODES}")
        with torch.inference_mode():
            child = self.add_sequence(child_id)
            child.fork_mode = parent.fork_mode = mode
            if parent.residual is not None:  # the residual buffer (<= g tokens) is copied: it is not paged
                child.residual.copy_from(parent.residual)
            self.refs.share(parent, child)
        return child

    def seal(self, seq: SeqKV) -> None:
        """A sequence that will write no more tokens of its own (a closed tree node): its pages are released
        as soon as evictions empty them (an open page would otherwise stay held)."""
        for table in seq.layers:
            table.seal()

    def share_written(self, owner: SeqKV, sharers: list[SeqKV], layer: int, positions) -> None:
        """Tokens just written into ``owner`` become visible to ``sharers``, by reference (``cache/forks.py``)."""
        self.refs.share_written(self.pools[layer], owner, sharers, layer, positions)

    def layer_scales(self, layer: int, fmt: str) -> LayerScales:
        return self.pools.layer_scales(layer, fmt)

    # --- pools ------------------------------------------------------------------------------
    @property
    def formats(self) -> tuple[str, ...] | None:
        """Every format the cache stores (None: whatever is written)."""
        return self.pools.formats

    @property
    def plan(self) -> PoolPlan:
        return self.pools.plan

    def allocate(self) -> None:
        """Allocate every planned pool, all at once (the first write does this)."""
        self.pools.allocate()

    def pool(self, layer: int, fmt: str) -> PagePool:
        return self.pools.pool(layer, fmt)

    def capacity_pages(self, fmt: str) -> int:
        """Pages of one (layer, format) pool."""
        return self.pools.capacity_pages(fmt)

    def capacity_groups(self, fmt: str) -> int:
        """Key-scale groups of one (layer, format) pool's arena."""
        return self.pools.capacity_groups(fmt)

    def prepare(self, pages: Mapping[str, int], groups: Mapping[str, int]) -> None:
        """Ready the pages (and key-scale groups) per (layer, format) pool that admission reserved, before the
        decode steps that hand them out (on CPU, their memory's first touch)."""
        self.pools.prepare(pages, groups)

    @property
    def reserves_groups(self) -> bool:
        """Whether admission must reserve key-scale groups besides pages (a token-dropping policy's arena
        sized below one group per slot)."""
        return self.cfg.key_groups_per_page is not None and self.pools.drops_tokens

    # --- slots ------------------------------------------------------------------------------
    def alloc_slots(self, seq: SeqKV, layer: int, cls: Cls, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Reuse evicted slots of the same class first (oldest page, lowest slot), then the open page's
        tail, and only then new pages (``BlockTable.alloc_slots``)."""
        return seq.layers[layer].alloc_slots(self.pool(layer, cls[0]), cls, n)

    def alloc_slots_each(self, seqs: list[SeqKV], layer: int, cls: Cls, counts: np.ndarray, queue: bool = True
                         ) -> tuple[np.ndarray, np.ndarray]:
        """``alloc_slots`` of ``counts[i]`` slots for each of ``seqs`` (distinct) in turn, by array operations
        (``batch_alloc.alloc_slots_each``): the slots concatenated in request order."""
        return alloc_slots_each(seqs, self.columns, layer, self.rows(seqs), self.pool(layer, cls[0]), cls, counts,
                                self._page_order, queue)

    def write(self, seq: SeqKV, layer: int, k: torch.Tensor, v: torch.Tensor, positions: list[int],
              cls: Cls, seg: int = -1) -> None:
        """Store ``k, v [n, H, D]`` (one flush group for quantized formats) of one request."""
        pool = self.pool(layer, cls[0])
        pages, slots = self.alloc_slots(seq, layer, cls, len(positions))
        gid = seq.alloc_group(layer, pool, len(positions))
        sc = self.layer_scales(layer, cls[0])
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        plugin_ops.kv_write(k, v, pool.fields, pool.group_fields, pool.k_group,
                            torch.from_numpy(pages).to(pool.device), torch.from_numpy(slots).to(pool.device),
                            gid, pool.fmt.code, sc.k, sc.v)
        if clk is not None:
            clk.switch(prev)
        self.record_written(seq, layer, pool, cls[0], pages, slots, positions, seg)

    def write_many(self, layer: int, seqs: list[SeqKV], k: torch.Tensor, v: torch.Tensor, counts: np.ndarray,
                   positions: np.ndarray, cls: Cls, segs: np.ndarray, g: int = 1) -> None:
        """The next ``counts[i]`` tokens of ``k, v [sum counts, H, D]`` (at ``positions``, of segments ``segs``) for
        each of ``seqs`` (distinct) in turn, with the slots ``alloc_slots_each`` gives them and one kernel call (a
        packed prefill's prompts): ``write`` of each (a format without key-scale groups), or with ``g > 1`` (every
        count a multiple of it) ``write_groups`` of each, its key-scale groups taken in that order."""
        pool = self.pool(layer, cls[0])
        pages, slots = self.alloc_slots_each(seqs, layer, cls, counts, queue=False)
        if g == 1:
            self._write_codes(layer, pool, k, v, _on(pool.device, pages), _on(pool.device, slots))
        else:
            per = counts // g
            gids = pool.alloc_groups(int(per.sum()), g)
            if gids is None:  # (the arena lacks them, or would grow: request by request, a full one names it)
                gids = np.fromiter((seq.alloc_group(layer, pool, g) for seq, n in zip(seqs, per.tolist())
                                    for _ in range(n)), np.int64)
            elif pool.group_specs:
                ByteAccount.add_each([seq.account for seq in seqs], (per * pool.group_bytes).tolist())
            self._write_group_codes(layer, pool, k, v, pages, slots, torch.from_numpy(gids), g)
        self.record_written_many(seqs, counts, layer, pool, cls[0], pages, slots, positions, segs)

    def write_groups(self, seq: SeqKV, layer: int, k: torch.Tensor, v: torch.Tensor, positions: list[int],
                     cls: Cls, seg: int, g: int) -> None:
        """``write`` of ``len(positions) // g`` consecutive groups of ``g`` tokens of one request (a quantized
        prompt): the slots and key-scale groups that ``write`` group after group takes, one kernel call."""
        pool = self.pool(layer, cls[0])
        pages, slots = self.alloc_slots(seq, layer, cls, len(positions))
        gids = torch.tensor([seq.alloc_group(layer, pool, g) for _ in range(len(positions) // g)], dtype=torch.int64)
        self._write_group_codes(layer, pool, k, v, pages, slots, gids, g)
        self.record_written(seq, layer, pool, cls[0], pages, slots, positions, seg)

    def _write_group_codes(self, layer: int, pool: PagePool, k: torch.Tensor, v: torch.Tensor, pages: np.ndarray,
                           slots: np.ndarray, gids: torch.Tensor, g: int) -> None:
        """Consecutive groups of ``g`` tokens into slots already allocated, group ``i`` with key-scale group
        ``gids[i]``, timed as "kv_write"."""
        G = len(gids)
        sc = self.layer_scales(layer, pool.fmt.name)
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        H, D = k.shape[1:]
        plugin_ops.kv_write_groups(k.reshape(G, g, H, D), v.reshape(G, g, H, D), pool.fields, pool.group_fields,
                                   pool.k_group, torch.from_numpy(pages).view(G, g).to(pool.device),
                                   torch.from_numpy(slots).view(G, g).to(pool.device), gids, pool.fmt.code, sc.k,
                                   sc.v)
        if clk is not None:
            clk.switch(prev)

    def write_through(self, layer: int, seqs: list[SeqKV], k: torch.Tensor, v: torch.Tensor,
                      positions: list[int], cls: Cls) -> None:
        """One token per request ``k, v [b, H, D]`` into a write-through format, in one kernel call."""
        pool = self.pool(layer, cls[0])
        rows = self.rows(seqs)
        pages, slots = alloc_one_each(seqs, self.columns, layer, rows, pool, cls, self._page_order)
        self._write_codes(layer, pool, k, v, _on(pool.device, pages), _on(pool.device, slots))
        pos = self._array_of(positions)
        pool.mark_written_distinct(pages, slots, pos)  # one slot in each of distinct pages: one call for the batch
        self.columns.place_rows(layer, rows, cls[0], pages, slots, pos)

    def plan_write_through(self, seqs: list[SeqKV], positions: list[int], cls: Cls, always: bool = False
                           ) -> WritePlan | None:
        """The slots of one token of each of ``seqs`` at ``positions`` in every layer, allocated and recorded at
        once (``trtkv/cache/write_plan.py``); each layer's ``write_planned`` then writes the codes. None when the
        plan does not apply (then ``write_through`` layer by layer) — unless ``always``: then ``write_through``'s
        own allocation, layer after layer, makes the plan."""
        rows, pos = self.rows(seqs), self._array_of(positions)
        plan = plan_write_through(self.pools, self.columns, seqs, rows, pos, cls, self._page_order)
        if plan is None and always:
            return plan_each_layer(self.pools, self.columns, seqs, rows, pos, cls, self._page_order)
        return plan

    def write_planned(self, plan: WritePlan, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write_through`` of layer ``layer`` into the slots ``plan`` recorded: the kernel call alone."""
        self._write_codes(layer, self.pool(layer, plan.cls[0]), k, v, plan.pages[layer], plan.slots[layer])

    def _write_codes(self, layer: int, pool: PagePool, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Tokens into slots already allocated (no flush group), timed as "kv_write"."""
        sc = self.layer_scales(layer, pool.fmt.name)
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        plugin_ops.kv_write(k, v, pool.fields, pool.group_fields, pool.k_group, pages, slots, -1, pool.fmt.code,
                            sc.k, sc.v)
        if clk is not None:
            clk.switch(prev)

    def _array_of(self, positions: list[int]) -> np.ndarray:
        """``positions`` as an int64 array, remembered for the same list like ``rows``."""
        last, arr = self._positions_of
        if last is not positions or len(arr) != len(positions):
            arr = np.asarray(positions, np.int64)
            self._positions_of = (positions, arr)
        return arr

    def record_written(self, seq: SeqKV, layer: int, pool: PagePool, fmt: str, pages: np.ndarray,
                       slots: np.ndarray, positions: list[int], seg: int | np.ndarray = -1) -> None:
        """Slots just allocated to ``seq`` now hold the tokens at ``positions`` (their codes are written, or
        will be before anything reads them: ``cache/pending.py``)."""
        pages, slots = pages.tolist(), slots.tolist()
        pool.mark_written(pages, slots, positions, seg)
        seq.layers[layer].place(fmt, pages, slots, positions)

    def record_written_many(self, seqs: list[SeqKV], counts: np.ndarray, layer: int, pool: PagePool, fmt: str,
                            pages: np.ndarray, slots: np.ndarray, positions: np.ndarray, segs: np.ndarray) -> None:
        """``record_written`` of several requests at once: the first ``counts[0]`` entries are ``seqs[0]``'s, ..."""
        pool.mark_written(pages, slots, positions, segs)
        rows = np.repeat(np.fromiter((s.row for s in seqs), np.int64, len(seqs)), counts)
        self.columns.place_flat(layer, rows, fmt, pages, slots, positions)

    # --- residual buffer --------------------------------------------------------------------
    def buffer_append(self, layer: int, seqs: list[SeqKV], k: torch.Tensor, v: torch.Tensor,
                      positions: list[int]) -> None:
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        rows = self.residual_rows(seqs)
        self.residual.append_rows(layer, rows, k, v, self._array_of(positions), distinct=self._residual_distinct)
        if clk is not None:
            clk.switch(prev)

    def plan_buffer_append(self, seqs: list[SeqKV], positions: list[int]) -> torch.Tensor | None:
        """``buffer_append`` of every layer recorded at once (``ResidualArena.plan_append``): the buffer slots
        ``[layers, b]`` whose K/V ``buffer_append_planned`` writes layer by layer; None (nothing done) when a
        buffer fills up this step (its layers append and flush one by one)."""
        rows = self.residual_rows(seqs)
        planned = self.residual.plan_append(rows, self._array_of(positions)) if self._residual_distinct else None
        if planned is None:
            return None
        at = torch.from_numpy(planned[0])
        return at if self.residual.k.device.type == "cpu" else at.to(self.residual.k.device)

    def buffer_append_planned(self, at: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s K/V into the buffer slots ``plan_buffer_append`` recorded: the kernel call alone."""
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        plugin_ops.residual_append(self.residual.k, self.residual.v, at[layer], k, v)
        if clk is not None:
            clk.switch(prev)

    def flush(self, seq: SeqKV, layer: int, cls: Cls, seg: int = -1) -> None:
        """Quantize the buffered tokens of one layer as one group and write them to pages."""
        self.flush_many(layer, [seq], [cls], [seg])

    def flush_many(self, layer: int, seqs: list[SeqKV], classes: list[Cls], segs: list[int],
                   plan: FlushPlan | None = None) -> None:
        """``flush`` of several requests in one layer, batched (``trtkv/cache/flush.py``); ``plan``: every layer's
        pages, taken when the step's first layer flushed (``plan_flush``)."""
        flush_many(self.pools, self.residual, self.columns, layer, seqs, self.rows(seqs), self.residual_rows(seqs),
                   classes, segs, self._page_order, self.clock, plan)

    def plan_flush(self, seqs: list[SeqKV], classes: list[Cls], charge_each_layer: bool = False
                   ) -> FlushPlan | None:
        """Every layer's pages for a flush of every one of ``seqs`` whose buffers all fill this step, taken at once
        when layer 0 flushes (``trtkv/cache/flush.py``; ``charge_each_layer``: bytes as each layer flushes); None
        when it does not apply."""
        return plan_flush(self.pools, self.residual, self.columns, seqs, self.rows(seqs), self.residual_rows(seqs),
                          classes, self._page_order, charge_each_layer)

    def discard_buffered(self, seq: SeqKV, layer: int) -> list[int]:
        """Empty one layer's residual buffer without writing it (a runtime that wrote the group to pages
        itself, ``trtkv/export/ort_core.py``); returns the positions it held."""
        return seq.residual.take(layer) if seq.residual is not None else []

    def rollback(self, seq: SeqKV, layer: int, pos: int) -> None:
        """Forget one token written in ``layer`` (a step undone): from the residual buffer or the pages.
        Not counted as an eviction."""
        if seq.residual is not None and seq.residual.discard(layer, pos):
            return
        if pos in seq.layers[layer]:
            self.evict(seq, layer, [pos], counted=False)

    # --- eviction ---------------------------------------------------------------------------
    def evict(self, seq: SeqKV, layer: int, positions, counted: bool = True) -> int:
        """Mark the tokens at ``positions`` evicted in one layer. In-place mode touches metadata only and
        makes the slots reusable by later tokens of the same class; compact mode then gathers the
        survivors together. Returns the number of tokens evicted. ``counted=False``: a move or a rollback,
        not an eviction (the eviction counters stay)."""
        positions = positions.tolist() if hasattr(positions, "tolist") else positions
        # a few victims (a sliding window's one token a step) cost less one by one than numpy's per-call overhead
        one_by_one = seq.fork_mode is not None or len(positions) < EVICT_BATCH_MIN
        n = self._evict_each(seq, layer, positions) if one_by_one else \
            evict_private(self.pools[layer], self.columns, layer, seq, positions, self.cfg.eviction != "compact")
        self._evicted(seq, layer, n, counted)
        return n

    def evict_many(self, layer: int, items: list[tuple[SeqKV, object]], counted: bool = True) -> list[int]:
        """``evict`` of several requests in one layer: in one pass over the batch (``evict_private_many``, the
        same end state as ``evict`` of each in turn, few victims or many) unless a request is forked."""
        items = [(s, p.reshape(-1) if isinstance(p, np.ndarray) else list(p)) for s, p in items]
        if (counted and self.cfg.eviction != "compact" and max(map(len, (p for _, p in items)), default=0) <= 1
                and all(s.fork_mode is None for s, _ in items) and len({id(s) for s, _ in items}) == len(items)):
            return self.evict_one_each(layer, [s for s, _ in items], [int(p[0]) if len(p) else -1 for _, p in items])
        repeated = len({id(s) for s, _ in items}) != len(items)  # compaction after each of its jobs, not once
        if any(s.fork_mode is not None for s, _ in items) or sum(map(len, (p for _, p in items))) < EVICT_BATCH_MIN \
                or (repeated and self.cfg.eviction == "compact"):
            return [self.evict(s, layer, p) if counted else self.evict(s, layer, p, False) for s, p in items]
        counts = evict_private_many(self.pools[layer], self.columns, layer, items, self.cfg.eviction != "compact")
        if counted:
            self._count_evicted([s for s, _ in items], counts)
        if self.cfg.eviction == "compact":
            self._compact_hit(layer, [s for s, _ in items], counts)
        return counts

    def _compact_hit(self, layer: int, seqs: list[SeqKV], counts: list[int]) -> None:
        """Compaction after an eviction of ``seqs``' ``counts`` tokens: every request that lost tokens, in order, each
        once."""
        hit = list({id(seq): seq for seq, n in zip(seqs, counts) if n}.values())
        moved = self._compact_rows(layer, hit) if len(hit) > 1 and not len(self.refs) else None
        if moved is None and hit:
            moved = compaction.compact_many(self.pools[layer], self.refs, hit, layer)
        self.compaction_moves += moved or 0

    def _compact_rows(self, layer: int, seqs: list[SeqKV]) -> int | None:
        """``compaction.compact_rows`` of ``seqs`` from the batch's block tables (None: not done)."""
        rows = self.rows(seqs)
        tables = self._batch_tables.layer_rows(seqs, self.columns, rows, layer, list(self.pools[layer]))
        return compaction.compact_rows(self.pools[layer], self.columns, seqs, rows, layer, tables)

    def evict_flat(self, layer: int, seqs: list[SeqKV], positions: np.ndarray, lens: np.ndarray,
                   counted: bool = True) -> list[int]:
        """``evict_many`` with the victims concatenated, ``lens[i]`` of ``positions`` the ``i``-th job's (of
        ``seqs[i]``, which may repeat): a batch's anneal or event without an array per job; a compacting cache
        compacts every request hit once, after the eviction."""
        compact = self.cfg.eviction == "compact"
        repeated = len({id(s) for s in seqs}) != len(seqs)  # (compaction follows each of its jobs: one by one)
        if (int(lens.sum()) < EVICT_BATCH_MIN or int(lens.max(initial=0)) <= 1
                or any(s.fork_mode is not None for s in seqs) or (compact and repeated)):
            return self.evict_many(layer, list(zip(seqs, split_counts(positions, lens))), counted)
        counts = evict_private_flat(self.pools[layer], self.columns, layer, seqs, positions, lens, not compact)
        if counted:
            self._count_evicted(seqs, counts)
        if compact:
            self._compact_hit(layer, seqs, counts)
        return counts

    def _count_evicted(self, seqs: list[SeqKV], counts: list[int]) -> None:
        """A batch's eviction counts in one array update (a request may appear more than once)."""
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        self.columns.count_evicted(rows, np.asarray(counts, np.int64))
        self.evictions_total += int(sum(counts))

    def evict_one_each(self, layer: int, seqs: list[SeqKV], positions) -> list[int]:
        """``evict`` of at most one position of each of ``seqs`` (distinct, unforked; -1: none) in one layer, by
        array operations (``trtkv/cache/eviction.py``); in-place eviction only."""
        rows, counts = evict_one_each(self.pools[layer], self.columns, layer, seqs, self.rows(seqs),
                                      np.asarray(positions, np.int64))
        self.columns.count_evicted(rows, counts)
        self.evictions_total += int(counts.sum())
        return counts.tolist()

    def evict_one_each_layers(self, layers: np.ndarray, seqs: list[SeqKV], positions: np.ndarray) -> None:
        """``evict_one_each`` in each of ``layers`` (ascending) with ``positions [len(layers), len(seqs)]``, at once
        where every format's slot state is stacked and has no key-scale arena, else layer by layer."""
        if not self._evicts_layers_at_once():
            for layer, victims in zip(layers.tolist(), positions):
                self.evict_one_each(layer, seqs, victims)
            return
        self._evict_rows_layers(layers, seqs, positions)

    def evict_rows_layers(self, layers: np.ndarray, seqs: list[SeqKV], positions: np.ndarray, counted: bool = True
                          ) -> np.ndarray:
        """``m`` positions of each of ``seqs`` (distinct, unforked) in each of ``layers`` (ascending): ``positions
        [len(layers), len(seqs), m]`` (distinct within a request; -1: none), at once where every format's slot state
        is stacked and has no key-scale arena (in-place eviction), else one ``evict_flat`` a layer. Returns each
        request's evictions, summed over the layers (``counted`` False: a move, not counted as evictions)."""
        if self.cfg.eviction == "compact" or not self._evicts_layers_at_once():
            counts = np.zeros(len(seqs), np.int64)
            for layer, victims in zip(layers.tolist(), positions):
                counts += self.evict_flat(layer, seqs, victims[victims >= 0], (victims >= 0).sum(1), counted)
            return counts
        return self._evict_rows_layers(layers, seqs, positions, counted)

    def _evicts_layers_at_once(self) -> bool:
        fmts = self.pools[0]
        return bool(fmts) and all(self.pools.stack(f) is not None and not p.group_specs for f, p in fmts.items())

    def _evict_rows_layers(self, layers: np.ndarray, seqs: list[SeqKV], positions: np.ndarray, counted: bool = True
                           ) -> np.ndarray:
        rows = self.rows(seqs)
        counts = evict_rows_layers(self.pools, self.columns, layers, seqs, rows, positions)
        if counted:
            self.columns.count_evicted(rows, counts)
            self.evictions_total += int(counts.sum())
        return counts

    def count_evicted(self, seq: SeqKV, n: int) -> None:
        """Count ``n`` tokens of ``seq`` as evicted (dropped from whichever tier held them)."""
        seq.count_evicted(n)
        self.evictions_total += n

    def _evicted(self, seq: SeqKV, layer: int, n: int, counted: bool = True, compact: bool = True) -> None:
        """Account ``n`` tokens just evicted from one layer (and gather the survivors in compact mode)."""
        if counted:
            self.count_evicted(seq, n)
        if n and compact and self.cfg.eviction == "compact":
            self.compact(seq, layer)

    def _evict_each(self, seq: SeqKV, layer: int, positions: list[int]) -> int:
        """Eviction one token at a time (``eviction.evict_one_by_one``: shared pages of forked sequences)."""
        return evict_one_by_one(self.pools[layer], self.refs, self.seqs, seq, layer, positions)

    def compact(self, seq: SeqKV, layer: int) -> None:
        """Gather compaction of one layer (``trtkv/cache/compaction.py``)."""
        self.compaction_moves += compaction.compact(self.pools[layer], self.refs, seq, layer)


def _on(device: torch.device, a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor on ``device`` (on CPU, a view of the array: no copy and no ``.to`` call)."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)


def fp16_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """What an uncompressed fp16 cache holds per token (the ``kv_bytes_full`` reference)."""
    return num_layers * 2 * num_kv_heads * head_dim * 2
