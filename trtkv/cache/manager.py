"""The paged KV cache: per-layer page pools per format, per-request block tables, residual buffers.

A policy *decides* which token positions to evict and which format/thought a flush group gets; this
manager *executes*: it allocates slots (reusing evicted slots of the same class in place — ThinKV's
Continuous Thinking — before touching tail capacity or new pages), writes through the ``kv_write``
plugin, flips validity bits on eviction (metadata only), or compacts by gather when configured to,
and accounts every byte it holds.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from plugins.formats import KVFormat, LayerScales, get_format
from plugins import ops as plugin_ops  # the ops' entry points; see plugins/ops.py
from trtkv.cache import compaction, forks, reads
from trtkv.cache.budget import PoolPlan, plan_pools
from trtkv.cache.config import CACHE_SETTINGS, EVICTION_MODES, MAX_BLOCK_SIZE, CacheConfig  # noqa: F401 (re-exported)
from trtkv.cache.eviction import decref_groups, evict_private, evict_private_many
from trtkv.cache.flush import flush_many
from trtkv.cache.pool import PagePool
from trtkv.cache.residual import ResidualArena
from trtkv.errors import OutOfKVMemory, TrtkvError

EVICT_BATCH_MIN = 8  # evictions of fewer tokens go one by one (same end state; see KVCacheManager.evict)

Cls = tuple[str, int]  # (format name, thought class): a page holds tokens of exactly one class


class LayerTable:
    """One request's pages in one layer. Positions map to (format, page, slot)."""

    def __init__(self) -> None:
        self.pages: dict[Cls, list[int]] = {}
        self.open_page: dict[Cls, int] = {}  # the page of a class with never-written tail slots
        self.reusable: dict[Cls, list[tuple[int, int, int]]] = {}  # heap of (page seq, page, slot)
        self.page_seq: dict[tuple[str, int], int] = {}  # allocation order of live pages
        self.loc: dict[int, tuple[str, int, int]] = {}  # position -> (format, page, slot)
        self._flat: dict[str, np.ndarray] | None = None
        self._bt: list | None = None  # cached single-request block tables, reset with _flat
        self.holes = False  # an eviction ever hit this table (its live slots are no longer a prefix)

    def pages_of_format(self) -> dict[str, np.ndarray]:
        """Pages per format in table order, as int32 arrays (a batch's block table is copied from them every
        layer of every step); rebuilt only when the page lists change (``_flat`` is reset with them)."""
        if self._flat is None:
            flat: dict[str, list[int]] = {}
            for (fmt, _), pages in self.pages.items():
                flat.setdefault(fmt, []).extend(pages)
            self._flat = {f: np.asarray(p, np.int32) for f, p in flat.items()}
        return self._flat

    @property
    def live(self) -> int:
        return len(self.loc)


@dataclass
class SeqKV:
    """Cache state of one request."""

    seq_id: int
    layers: list[LayerTable]
    buf_k: torch.Tensor | None = None  # [L, g, H, D] residual buffer: a row of the cache's ResidualArena
    buf_v: torch.Tensor | None = None
    buf_row: int = -1  # that row
    buf_pos: list[list[int]] = field(default_factory=list)  # per layer, positions in the buffer
    kv_bytes: int = 0  # running total: pages + key-scale groups + residual buffer
    peak_bytes: int = 0
    evicted_tokens: int = 0  # summed over layers
    fork_mode: str | None = None  # set once the sequence shares pages: "cow" or "tree" (see cache/forks.py)

    def add_bytes(self, n: int) -> None:
        self.kv_bytes += n
        if self.kv_bytes > self.peak_bytes:
            self.peak_bytes = self.kv_bytes

    def buffered(self, layer: int = 0) -> int:
        return len(self.buf_pos[layer]) if self.buf_pos else 0


class KVCacheManager:
    """``formats``: every format the cache will store (the policy's ``pool_formats()``), so ``kv_memory``
    can be split among them; ``drops_tokens``: whether the policy may drop tokens (sizes the key-scale
    arenas, see ``trtkv/cache/budget.py``); ``useful_pages``: the most pages a pool could ever hold (caps the
    default budget). The pools are sized and allocated once, on first use."""

    def __init__(self, cfg: CacheConfig, kv_amax: dict | None = None, formats=None, drops_tokens: bool = True,
                 useful_pages: int | None = None):
        self.cfg = cfg
        self.kv_amax = kv_amax  # {"k": [per layer], "v": [per layer]} from calibration, or None
        self.formats = tuple(sorted(formats)) if formats is not None else None
        self.drops_tokens = drops_tokens
        self.useful_pages = useful_pages
        self._plan: PoolPlan | None = None
        self._scales: dict[tuple[int, str], LayerScales] = {}
        self.pools: list[dict[str, PagePool]] = [{} for _ in range(cfg.num_layers)]
        self.seqs: dict[int, SeqKV] = {}
        self._batch_bt: list = [None] * cfg.num_layers  # per layer, the last batch's block tables (reads.py)
        self._page_counter = 0
        self.evictions_total = 0
        self.compaction_moves = 0  # tokens copied by gather compaction
        self._tiers = None
        self.refs = forks.PageRefs()  # pages shared by forked sequences (cache/forks.py)
        self.cow_copies = 0  # pages copied because a sharer evicted from them
        self.clock = None  # the engine's decode-step profile clock (runtime/observers.py::PhaseClock), if any
        self.residual = ResidualArena(cfg) if cfg.residual_group > 1 else None  # every request's residual buffer

    @property
    def tiers(self):
        """The host tiers of this cache (T1/T2; ``trtkv.cache.tiers.TierStore``), created on first use."""
        if self._tiers is None:
            from trtkv.cache.tiers import TierStore

            self._tiers = TierStore(self)
        return self._tiers

    # --- requests ---------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> SeqKV:
        c = self.cfg
        seq = SeqKV(seq_id, [LayerTable() for _ in range(c.num_layers)])
        if self.residual is not None:
            self.residual.acquire(seq, list(self.seqs.values()))
            seq.buf_pos = [[] for _ in range(c.num_layers)]
            seq.add_bytes(2 * seq.buf_k.numel() * seq.buf_k.element_size())
        self.seqs[seq_id] = seq
        return seq

    def free_sequence(self, seq_id: int) -> None:
        """Return every page and key-scale group of the request to the pools, at once."""
        seq = self.seqs.pop(seq_id)
        if self.residual is not None:
            self.residual.release(seq)
        if self._tiers is not None:  # the request's host-tier pages go too
            self._tiers.free(seq_id)
        for layer, table in enumerate(seq.layers):
            for (fmt, _), pages in table.pages.items():
                pool = self.pools[layer][fmt]
                for p in pages:
                    if forks.release_sequence_page(self, seq, layer, fmt, p):
                        continue  # another sequence still holds it
                    self._drop_page_tokens(seq, pool, p)
                    pool.release_page(p)
                    seq.add_bytes(-(pool.page_bytes + 4))

    def _drop_page_tokens(self, seq: SeqKV, pool: PagePool, p: int) -> None:
        """Drop every live token of a page being released: one reference drop per key-scale group, not per
        token (a finished 4k-token request holds ~8k such slots per layer)."""
        bits = int(pool.valid[p])
        if not bits:
            return
        if pool.group_specs:
            row = pool.k_group[p].tolist()
            decref_groups(seq, pool, [row[s] for s in range(pool.B) if bits >> s & 1])
        pool.clear_page(p)

    def layer_scales(self, layer: int, fmt: str) -> LayerScales:
        """Static second-level / tensor scales of a format in a layer, from the calibrated K/V amax
        (1.0 without calibration)."""
        key = (layer, fmt)
        if key not in self._scales:
            from plugins.formats.quantized import calibrate_layer_scales

            if self.kv_amax:
                self._scales[key] = calibrate_layer_scales(float(self.kv_amax["k"][layer]),
                                                           float(self.kv_amax["v"][layer]), get_format(fmt))
            else:
                self._scales[key] = LayerScales()
        return self._scales[key]

    # --- pools ------------------------------------------------------------------------------
    @property
    def plan(self) -> PoolPlan:
        """The pools' sizes, decided once (``trtkv/cache/budget.py``); nothing is allocated until a pool is
        first used, so a core that never runs (e.g. an engine's own, while a tool runs its core) costs nothing."""
        if self._plan is None:
            self._plan = plan_pools(self.cfg, self.formats, self.drops_tokens, self.useful_pages)
        return self._plan

    def allocate(self) -> None:
        """Allocate every planned pool, all at once (the first write does this)."""
        plan = self.plan
        for layer in range(self.cfg.num_layers):
            for fmt in plan.formats or ():
                if fmt not in self.pools[layer]:
                    self.pools[layer][fmt] = self._new_pool(fmt, plan)

    def _new_pool(self, fmt: str, plan: PoolPlan) -> PagePool:
        c = self.cfg
        try:
            return PagePool(get_format(fmt), c.num_kv_heads, c.head_dim, c.block_size, c.device, plan.pages,
                            plan.groups(fmt, c))
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise OutOfKVMemory(f"could not allocate the {fmt} KV pools ({plan.pages} pages per layer) on "
                                f"{c.device}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; lower "
                                f"--kv-memory or kv_memory_fraction") from None

    def pool(self, layer: int, fmt: str) -> PagePool:
        pools = self.pools[layer]
        if fmt not in pools:
            self.allocate()
            plan = self.plan
            if fmt not in pools:
                if plan.formats is not None:
                    raise TrtkvError(f"the KV cache has no {fmt} pool (its pools: {', '.join(plan.formats)}); "
                                     f"the policy must list every format it stores in pool_formats()")
                pools[fmt] = self._new_pool(fmt, plan)
        return pools[fmt]

    def capacity_pages(self, fmt: str) -> int:
        """Pages of one (layer, format) pool."""
        return self.plan.pages

    # --- slots ------------------------------------------------------------------------------
    def alloc_slots(self, seq: SeqKV, layer: int, cls: Cls, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Reuse evicted slots of the same class first (oldest page, lowest slot), then the open page's
        tail, and only then new pages. (One slot a request at a time, the decode step's case: ``alloc_one``.)"""
        table, pool = seq.layers[layer], self.pool(layer, cls[0])
        heap = table.reusable.get(cls)
        pages, slots = [], []
        if heap:
            page_seq, valid, fmt = table.page_seq, pool.valid, cls[0]
            while heap and len(pages) < n:
                seq_no, p, s = heapq.heappop(heap)
                if page_seq.get((fmt, p)) != seq_no or valid.item(p) >> s & 1:
                    continue  # stale entry: page released (maybe reallocated, to any class) or slot refilled
                pages.append(p)
                slots.append(s)
        while len(pages) < n:
            p = table.open_page.get(cls)
            if p is None:
                try:
                    p = pool.alloc_page(cls[1])
                except OutOfKVMemory as e:
                    raise e.at(seq.seq_id, layer, cls[0]) from None
                self._page_counter += 1
                table.page_seq[(cls[0], p)] = self._page_counter
                table.pages.setdefault(cls, []).append(p)
                table.open_page[cls] = p
                table._flat = table._bt = None
                seq.add_bytes(pool.page_bytes + 4)  # page + its block-table entry
            take = min(pool.B - int(pool.hwm[p]), n - len(pages))
            start = int(pool.hwm[p])
            pages.extend([p] * take)
            slots.extend(range(start, start + take))
            pool.hwm[p] = start + take
            if pool.hwm[p] >= pool.B:
                del table.open_page[cls]
        return np.asarray(pages, np.int64), np.asarray(slots, np.int64)

    def alloc_one(self, seq: SeqKV, layer: int, cls: Cls) -> tuple[int, int]:
        """``alloc_slots(seq, layer, cls, 1)`` as two ints (a decode step's write, per request and layer):
        the same choice — a reusable slot of the class, else the open page's tail, else a new page —
        without building arrays."""
        table, pool = seq.layers[layer], self.pool(layer, cls[0])
        heap = table.reusable.get(cls)
        while heap:
            seq_no, p, s = heapq.heappop(heap)
            if table.page_seq.get((cls[0], p)) == seq_no and not pool.valid[p] >> s & 1:
                return int(p), int(s)
        p = table.open_page.get(cls)
        if p is None:  # a new page: the general path
            pages, slots = self.alloc_slots(seq, layer, cls, 1)
            return int(pages[0]), int(slots[0])
        s = int(pool.hwm[p])
        pool.hwm[p] = s + 1
        if s + 1 >= pool.B:
            del table.open_page[cls]
        return int(p), s

    def write(self, seq: SeqKV, layer: int, k: torch.Tensor, v: torch.Tensor, positions: list[int],
              cls: Cls, seg: int = -1) -> None:
        """Store ``k, v [n, H, D]`` (one flush group for quantized formats) of one request."""
        pool = self.pool(layer, cls[0])
        pages, slots = self.alloc_slots(seq, layer, cls, len(positions))
        gid = self.alloc_group(seq, layer, pool, len(positions))
        sc = self.layer_scales(layer, cls[0])
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        plugin_ops.kv_write(k, v, pool.fields, pool.group_fields, pool.k_group,
                                 torch.from_numpy(pages).to(pool.device), torch.from_numpy(slots).to(pool.device),
                                 gid, pool.fmt.code, sc.k, sc.v)
        if clk is not None:
            clk.switch(prev)
        self._record(seq, layer, pool, cls[0], pages, slots, positions, seg)

    def alloc_group(self, seq: SeqKV, layer: int, pool: PagePool, n: int) -> int:
        """A key-scale arena entry for a group of ``n`` tokens of ``seq`` (-1: the format has none), charged
        to the request; a full arena names the request and layer."""
        try:
            gid = pool.alloc_group(n)
        except OutOfKVMemory as e:
            raise e.at(seq.seq_id, layer, pool.fmt.name) from None
        if gid >= 0:
            seq.add_bytes(pool.group_bytes)
        return gid

    def write_through(self, layer: int, seqs: list[SeqKV], k: torch.Tensor, v: torch.Tensor,
                      positions: list[int], cls: Cls) -> None:
        """One token per request ``k, v [b, H, D]`` into a write-through format, in one kernel call."""
        pool = self.pool(layer, cls[0])
        allocs = [self.alloc_one(s, layer, cls) for s in seqs]
        pages, slots = [p for p, _ in allocs], [s for _, s in allocs]
        sc = self.layer_scales(layer, cls[0])
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        plugin_ops.kv_write(k, v, pool.fields, pool.group_fields, pool.k_group,
                                 torch.tensor(pages, device=pool.device), torch.tensor(slots, device=pool.device),
                                 -1, pool.fmt.code, sc.k, sc.v)
        if clk is not None:
            clk.switch(prev)
        pool.mark_written(pages, slots, positions, -1)  # distinct slots: one call for the batch
        self._locate((s.layers[layer].loc for s in seqs), cls[0], pages, slots, positions)

    def _record(self, seq, layer, pool, fmt, pages, slots, positions, seg) -> None:
        pages, slots = pages.tolist(), slots.tolist()
        pool.mark_written(pages, slots, positions, seg)
        self._locate(itertools.repeat(seq.layers[layer].loc), fmt, pages, slots, positions)

    @staticmethod
    def _locate(locs, fmt, pages, slots, positions) -> None:
        """Where each written position now lives: ``loc[pos] = (format, page, slot)``, each position in its
        own table's ``loc`` (one request's for a write, one per request for a batch's write-through)."""
        for loc, p, s, pos in zip(locs, pages, slots, positions):
            loc[pos] = (fmt, p, s)

    # --- residual buffer --------------------------------------------------------------------
    def buffer_append(self, layer: int, seqs: list[SeqKV], k: torch.Tensor, v: torch.Tensor,
                      positions: list[int]) -> None:
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        self.residual.append(layer, seqs, k, v, positions)  # one indexed write for the batch
        if clk is not None:
            clk.switch(prev)

    def flush(self, seq: SeqKV, layer: int, cls: Cls, seg: int = -1) -> None:
        """Quantize the buffered tokens of one layer as one group and write them to pages."""
        flush_many(self, layer, [seq], [cls], [seg])

    def flush_many(self, layer: int, seqs: list[SeqKV], classes: list[Cls], segs: list[int]) -> None:
        """``flush`` of several requests in one layer, batched (``trtkv/cache/flush.py``)."""
        flush_many(self, layer, seqs, classes, segs)

    # --- eviction ---------------------------------------------------------------------------
    def evict(self, seq: SeqKV, layer: int, positions) -> int:
        """Mark the tokens at ``positions`` evicted in one layer. In-place mode touches metadata only and
        makes the slots reusable by later tokens of the same class; compact mode then gathers the
        survivors together. Returns the number of tokens evicted."""
        positions = positions.tolist() if hasattr(positions, "tolist") else positions
        # a few victims (a sliding window's one token a step) cost less one by one than numpy's per-call overhead
        one_by_one = seq.fork_mode is not None or len(positions) < EVICT_BATCH_MIN
        n = self._evict_each(seq, layer, positions) if one_by_one else evict_private(self, seq, layer, positions)
        self._evicted(seq, layer, n)
        return n

    def evict_many(self, layer: int, items: list[tuple[SeqKV, object]]) -> list[int]:
        """``evict`` of several requests in one layer: in one pass over the batch (``evict_private_many``, the
        same end state as ``evict`` of each in turn, few victims or many) unless a request is forked."""
        items = [(s, p.tolist() if hasattr(p, "tolist") else list(p)) for s, p in items]
        if any(s.fork_mode is not None for s, _ in items) or sum(map(len, (p for _, p in items))) < EVICT_BATCH_MIN:
            return [self.evict(s, layer, p) for s, p in items]
        counts = evict_private_many(self, layer, items)
        for (seq, _), n in zip(items, counts):
            self._evicted(seq, layer, n)
        return counts

    def _evicted(self, seq: SeqKV, layer: int, n: int) -> None:
        """Account ``n`` tokens just evicted from one layer (and gather the survivors in compact mode)."""
        seq.evicted_tokens += n
        self.evictions_total += n
        if n and self.cfg.eviction == "compact":
            self.compact(seq, layer)

    def _evict_each(self, seq: SeqKV, layer: int, positions: list[int]) -> int:
        """Eviction one token at a time: a forked sequence's pages may be shared (copy on write, or tree
        eviction in place; cache/forks.py)."""
        table = seq.layers[layer]
        table.holes = True
        n = 0
        for pos in positions:
            where = table.loc.pop(int(pos), None)
            if where is None:
                continue
            fmt, p, s = where
            pool = self.pools[layer][fmt]
            if self.refs.sharers(layer, fmt, p):  # a page other sequences hold too
                if seq.fork_mode == "tree":
                    forks.evict_shared(self, seq, layer, fmt, p, s, int(pos))
                    n += 1
                    continue
                p = forks.make_private(self, seq, layer, fmt, p)
            if pool.group_specs and pool.decref_group(int(pool.k_group[p, s])):
                seq.add_bytes(-pool.group_bytes)
            pool.mark_evicted(p, s)
            cls = (fmt, int(pool.page_class[p]))
            heapq.heappush(table.reusable.setdefault(cls, []), (table.page_seq[(fmt, p)], p, s))
            if pool.live[p] == 0 and table.open_page.get(cls) != p:
                self._release(seq, table, pool, cls, p)
            n += 1
        return n

    def _release(self, seq: SeqKV, table: LayerTable, pool: PagePool, cls: Cls, p: int) -> None:
        table.pages[cls].remove(p)
        del table.page_seq[(cls[0], p)]
        table._flat = table._bt = None
        pool.release_page(p)
        seq.add_bytes(-(pool.page_bytes + 4))

    def compact(self, seq: SeqKV, layer: int) -> None:
        """Gather compaction of one layer (``trtkv/cache/compaction.py``)."""
        compaction.compact(self, seq, layer)

    # --- reads ------------------------------------------------------------------------------
    def live_positions(self, seq: SeqKV, layer: int) -> np.ndarray:
        """Positions held in pages (not the residual buffer), ascending."""
        loc = seq.layers[layer].loc
        pos = np.fromiter(loc, np.int64, len(loc))  # insertion order: ascending unless a tier restored some
        if len(pos) > 1 and not (pos[1:] > pos[:-1]).all():
            pos.sort()
        return pos

    def live_positions_in(self, seq: SeqKV, layer: int, lo: int, hi: int) -> np.ndarray:
        """Paged positions in ``[lo, hi)``, ascending: one membership test per position of a short range (a
        segment's members) instead of listing every held position."""
        loc = seq.layers[layer].loc
        lo, hi = max(int(lo), 0), int(hi)
        if hi <= lo:
            return np.empty(0, np.int64)
        if hi - lo > len(loc):  # a range wider than what is held: filter the held positions
            pos = self.live_positions(seq, layer)
            return pos[(pos >= lo) & (pos < hi)]
        held = np.fromiter(map(loc.__contains__, range(lo, hi)), bool, hi - lo)
        return np.arange(lo, hi, dtype=np.int64)[held]

    def gather_kv(self, seq: SeqKV, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized fp32 ``k, v [m, H, D]`` of paged tokens (``trtkv/cache/reads.py``)."""
        return reads.gather_kv(self, seq, layer, positions)

    def gather_kv_many(self, layer: int, items: list[tuple[SeqKV, object]], keys_only: bool = False
                       ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``gather_kv`` of several requests in one read per format (``trtkv/cache/reads.py``)."""
        return reads.gather_kv_many(self, layer, items, keys_only)

    def block_tables(self, layer: int, seqs: list[SeqKV]) -> list[tuple[PagePool, torch.Tensor]]:
        """Per format used in this layer: ``(pool, block_table [b, P] int32, -1 padded)``."""
        return reads.block_tables(self, layer, seqs)

    def dense_run(self, layer: int, seqs: list[SeqKV]) -> tuple[int, int] | None:
        """``(first page, live tokens)`` when a lone request's tokens are one dense run of pages."""
        return reads.dense_run(layer, seqs)

    # --- bytes ------------------------------------------------------------------------------
    def seq_bytes(self, seq: SeqKV) -> int:
        """Bytes the cache holds for this request: its pages (codes, scales, page metadata, block-table
        entries), the key-scale groups its live tokens point at, and its residual buffer."""
        return seq.kv_bytes

    def recount_bytes(self, seq: SeqKV) -> int:
        """The same total recomputed from the pools (the running counter's test oracle)."""
        total = 0 if seq.buf_k is None else 2 * seq.buf_k.numel() * seq.buf_k.element_size()
        for layer, table in enumerate(seq.layers):
            groups: set[tuple[str, int]] = set()
            for (fmt, _), pages in table.pages.items():
                pool = self.pools[layer][fmt]
                total += len(pages) * (pool.page_bytes + 4)
            for fmt, p, s in table.loc.values():
                pool = self.pools[layer][fmt]
                if pool.group_specs:
                    groups.add((fmt, int(pool.k_group[p, s])))
            total += sum(self.pools[layer][f].group_bytes for f, _ in groups)
        return total

    def live_tokens(self, seq: SeqKV) -> list[int]:
        return [t.live for t in seq.layers]

    def engine_bytes(self) -> int:
        """Bytes the cache holds across all requests, each physical page and key-scale group once (forked
        sequences share pages), plus every request's block-table entries and residual buffer."""
        total = 0
        for pools in self.pools:
            for pool in pools.values():
                total += pool.in_use * pool.page_bytes + pool.groups_in_use * pool.group_bytes
        for seq in self.seqs.values():
            total += 4 * sum(len(p) for t in seq.layers for p in t.pages.values())
            if seq.buf_k is not None:
                total += 2 * seq.buf_k.numel() * seq.buf_k.element_size()
        return total

    def pages_in_use(self) -> int:
        return sum(p.in_use for pools in self.pools for p in pools.values())

    def pool_bytes(self) -> int:
        """Bytes the pools reserved (allocated once, used or not)."""
        return sum(p.allocated_bytes() for pools in self.pools for p in pools.values())

    def pool_peak_bytes(self) -> int:
        """Bytes of the most pages and groups each pool had in use at once (what the runs needed)."""
        return sum(p.peak_bytes() for pools in self.pools for p in pools.values())


def fp16_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """What an uncompressed fp16 cache holds per token (the ``kv_bytes_full`` reference)."""
    return num_layers * 2 * num_kv_heads * head_dim * 2


def format_of(name: str) -> KVFormat:
    return get_format(name)
