"""The paged KV cache: per-layer page pools per format, per-request block tables, residual buffers.

A policy *decides* which token positions to evict and which format/thought a flush group gets; this
manager *executes*: it allocates slots (reusing evicted slots of the same class in place — ThinKV's
Continuous Thinking — before touching tail capacity or new pages), writes through the ``kv_write``
plugin, flips validity bits on eviction (metadata only), or compacts by gather when configured to,
and accounts every byte it holds.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from plugins.formats import KVFormat, LayerScales, get_format
from plugins import ops as plugin_ops  # the ops' entry points; see plugins/ops.py
from trtkv.cache import forks
from trtkv.cache.eviction import evict_private
from trtkv.cache.pool import PagePool
from trtkv.cache.residual import ResidualArena
from trtkv.errors import TrtkvError
from trtkv.sizes import parse_size

EVICTION_MODES = ("inplace", "compact")
MAX_BLOCK_SIZE = 31  # a page's validity bits fit one int32 word
EVICT_BATCH_MIN = 8  # evictions of fewer tokens go one by one (same end state; see KVCacheManager.evict)


@dataclass
class CacheConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 8
    residual_group: int = 1  # g: tokens held in full precision before a quantized flush (1 = write-through)
    residual_dtype: torch.dtype = torch.float16
    eviction: str = "inplace"  # "inplace": CT slot reuse; "compact": gather live tokens together (R-KV style)
    max_pages: int | None = None  # per (layer, format) pool; None grows on demand
    initial_pages: int = 8
    device: str = "cpu"
    kv_memory: int | None = None  # device KV bytes (pools, admission); None = a default chosen at engine start
    # --- tiered memory (trtkv/cache/tiers.py) ---
    demote: str = "none"  # a policy's evictions: "none" drop (T3), "host" move to T1, "host-<format>" to T2
    host_kv_memory: int | None = None  # host tiers' bytes cap; None = unbounded

    def __post_init__(self) -> None:
        self.validate_settings({"block_size": self.block_size, "eviction": self.eviction,
                                "max_pages": self.max_pages, "kv_memory": self.kv_memory,
                                "demote": self.demote, "host_kv_memory": self.host_kv_memory})

    @staticmethod
    def validate_settings(settings: dict[str, Any]) -> dict[str, Any]:
        """The one validator of user-settable cache settings (``--set``, ``engine.json``'s cache section,
        load-time overrides): ``block_size``, ``eviction``, ``max_pages``, ``kv_memory`` (bytes or a size
        like ``2GiB``) and the scheduler's ``max_batch``. Strings are parsed; returns typed values, raises
        one ``TrtkvError`` line naming the setting."""
        out: dict[str, Any] = {}
        for key, value in settings.items():
            if key not in CACHE_SETTINGS:
                raise TrtkvError(f"unknown cache setting {key!r}; cache settings are {', '.join(CACHE_SETTINGS)}")
            out[key] = _cache_setting(key, value)
        return out


CACHE_SETTINGS = ("block_size", "eviction", "max_batch", "max_pages", "kv_memory", "demote", "host_kv_memory")


def _cache_setting(key: str, value: Any) -> Any:
    def bad(why: str) -> TrtkvError:
        return TrtkvError(f"cache setting {key}={value!r}: {why}")

    text = value.strip().lower() if isinstance(value, str) else value
    if key == "eviction":
        if text not in EVICTION_MODES:
            raise bad(f"choose {' or '.join(EVICTION_MODES)}")
        return text
    if key == "demote":
        from trtkv.cache.tiers import parse_demote

        parse_demote(text)  # a bad value fails here, with one clear line
        return text
    if key in ("max_pages", "kv_memory", "host_kv_memory") and text in (None, "none", "null", "auto"):
        return None
    if key in ("kv_memory", "host_kv_memory"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad("expected a size in bytes, e.g. 2GiB or 512MiB")
        try:
            return parse_size(value)
        except TrtkvError as e:
            raise bad(str(e)) from None
    if isinstance(value, str):
        try:
            value = int(text)
        except ValueError:
            raise bad("expected a whole number") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad("expected a whole number")
    if key == "block_size" and not 1 <= value <= MAX_BLOCK_SIZE:
        raise bad(f"must be between 1 and {MAX_BLOCK_SIZE}")
    if value < 1:
        raise bad("must be positive")
    return value


Cls = tuple[str, int]  # (format name, thought class): a page holds tokens of exactly one class


class LayerTable:
    """One request's pages in one layer. Positions map to (format, page, slot)."""

    def __init__(self) -> None:
        self.pages: dict[Cls, list[int]] = {}
        self.open_page: dict[Cls, int] = {}  # the page of a class with never-written tail slots
        self.reusable: dict[Cls, list[tuple[int, int, int]]] = {}  # heap of (page seq, page, slot)
        self.page_seq: dict[tuple[str, int], int] = {}  # allocation order of live pages
        self.loc: dict[int, tuple[str, int, int]] = {}  # position -> (format, page, slot)
        self._flat: dict[str, list[int]] | None = None
        self._bt: list | None = None  # cached single-request block tables, reset with _flat
        self.holes = False  # an eviction ever hit this table (its live slots are no longer a prefix)

    def pages_of_format(self) -> dict[str, list[int]]:
        if self._flat is None:
            flat: dict[str, list[int]] = {}
            for (fmt, _), pages in self.pages.items():
                flat.setdefault(fmt, []).extend(pages)
            self._flat = flat
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
    def __init__(self, cfg: CacheConfig, kv_amax: dict | None = None):
        self.cfg = cfg
        self.kv_amax = kv_amax  # {"k": [per layer], "v": [per layer]} from calibration, or None
        self._scales: dict[tuple[int, str], LayerScales] = {}
        self.pools: list[dict[str, PagePool]] = [{} for _ in range(cfg.num_layers)]
        self.seqs: dict[int, SeqKV] = {}
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
        bits = int(pool.valid[p])
        for s in range(pool.B):
            if bits >> s & 1:
                if pool.group_specs and pool.decref_group(int(pool.k_group[p, s])):
                    seq.add_bytes(-pool.group_bytes)
                pool.mark_evicted(p, s)

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
    def pool(self, layer: int, fmt: str) -> PagePool:
        pools = self.pools[layer]
        if fmt not in pools:
            c = self.cfg
            pools[fmt] = PagePool(get_format(fmt), c.num_kv_heads, c.head_dim, c.block_size, c.device,
                                  c.initial_pages, c.max_pages)
        return pools[fmt]

    # --- slots ------------------------------------------------------------------------------
    def alloc_slots(self, seq: SeqKV, layer: int, cls: Cls, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Reuse evicted slots of the same class first (oldest page, lowest slot), then the open page's
        tail, and only then new pages."""
        table, pool = seq.layers[layer], self.pool(layer, cls[0])
        heap = table.reusable.get(cls)
        if n == 1 and not heap:  # fast path: next tail slot of the open page
            p = table.open_page.get(cls)
            if p is not None:
                s = int(pool.hwm[p])
                pool.hwm[p] = s + 1
                if s + 1 >= pool.B:
                    del table.open_page[cls]
                return np.array([p], np.int64), np.array([s], np.int64)
        pages, slots = [], []
        while heap and len(pages) < n:
            seq_no, p, s = heapq.heappop(heap)
            if table.page_seq.get((cls[0], p)) != seq_no or pool.valid[p] >> s & 1:
                continue  # stale entry: page released (maybe reallocated, to any class) or slot refilled
            pages.append(p)
            slots.append(s)
        while len(pages) < n:
            p = table.open_page.get(cls)
            if p is None:
                p = pool.alloc_page(cls[1])
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

    def write(self, seq: SeqKV, layer: int, k: torch.Tensor, v: torch.Tensor, positions: list[int],
              cls: Cls, seg: int = -1) -> None:
        """Store ``k, v [n, H, D]`` (one flush group for quantized formats) of one request."""
        pool = self.pool(layer, cls[0])
        pages, slots = self.alloc_slots(seq, layer, cls, len(positions))
        gid = pool.alloc_group(len(positions))
        if gid >= 0:
            seq.add_bytes(pool.group_bytes)
        sc = self.layer_scales(layer, cls[0])
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        plugin_ops.kv_write(k, v, pool.fields, pool.group_fields, pool.k_group,
                                 torch.from_numpy(pages).to(pool.device), torch.from_numpy(slots).to(pool.device),
                                 gid, pool.fmt.code, sc.k, sc.v)
        if clk is not None:
            clk.switch(prev)
        self._record(seq, layer, pool, cls[0], pages, slots, positions, seg)

    def write_through(self, layer: int, seqs: list[SeqKV], k: torch.Tensor, v: torch.Tensor,
                      positions: list[int], cls: Cls) -> None:
        """One token per request ``k, v [b, H, D]`` into a write-through format, in one kernel call."""
        pool = self.pool(layer, cls[0])
        allocs = [self.alloc_slots(s, layer, cls, 1) for s in seqs]
        if len(allocs) == 1:
            pages, slots = allocs[0]
        else:
            pages = np.concatenate([a[0] for a in allocs])
            slots = np.concatenate([a[1] for a in allocs])
        sc = self.layer_scales(layer, cls[0])
        clk = self.clock
        prev = clk.switch("kv_write") if clk is not None else None
        plugin_ops.kv_write(k, v, pool.fields, pool.group_fields, pool.k_group,
                                 torch.from_numpy(pages).to(pool.device), torch.from_numpy(slots).to(pool.device),
                                 -1, pool.fmt.code, sc.k, sc.v)
        if clk is not None:
            clk.switch(prev)
        for i, s in enumerate(seqs):
            self._record(s, layer, pool, cls[0], pages[i:i + 1], slots[i:i + 1], [positions[i]], -1)

    def _record(self, seq, layer, pool, fmt, pages, slots, positions, seg) -> None:
        pages, slots = pages.tolist(), slots.tolist()
        pool.mark_written(pages, slots, positions, seg)
        loc = seq.layers[layer].loc
        for p, s, pos in zip(pages, slots, positions):
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
        n = len(seq.buf_pos[layer])
        if n == 0:
            return
        pos = seq.buf_pos[layer]
        self.write(seq, layer, seq.buf_k[layer, :n].float(), seq.buf_v[layer, :n].float(), list(pos), cls, seg)
        seq.buf_pos[layer] = []

    # --- eviction ---------------------------------------------------------------------------
    def evict(self, seq: SeqKV, layer: int, positions) -> int:
        """Mark the tokens at ``positions`` evicted in one layer. In-place mode touches metadata only and
        makes the slots reusable by later tokens of the same class; compact mode then gathers the
        survivors together. Returns the number of tokens evicted."""
        positions = positions.tolist() if hasattr(positions, "tolist") else positions
        # a few victims (a sliding window's one token a step) cost less one by one than numpy's per-call overhead
        one_by_one = seq.fork_mode is not None or len(positions) < EVICT_BATCH_MIN
        n = self._evict_each(seq, layer, positions) if one_by_one else evict_private(self, seq, layer, positions)
        seq.evicted_tokens += n
        self.evictions_total += n
        if n and self.cfg.eviction == "compact":
            self.compact(seq, layer)
        return n

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
        """Gather compaction: move every class's live tokens to the front of its pages and free the rest.

        This copies K/V codes (what R-KV and AMS do after eviction); the in-place mode never does."""
        table = seq.layers[layer]
        for cls, pages in list(table.pages.items()):  # gathering writes: shared pages are copied first
            for p in [p for p in pages if self.refs.sharers(layer, cls[0], p)]:
                forks.make_private(self, seq, layer, cls[0], p)
        for cls, pages in list(table.pages.items()):
            pool = self.pools[layer][cls[0]]
            src = [(p, s) for p in pages for s in range(pool.B) if pool.valid[p] >> s & 1]
            dst = [(pages[i // pool.B], i % pool.B) for i in range(len(src))]
            moves = [(a, b) for a, b in zip(src, dst) if a != b]
            if moves:
                sp = torch.tensor([a[0] for a, _ in moves], device=pool.device)
                ss = torch.tensor([a[1] for a, _ in moves], device=pool.device)
                dp = torch.tensor([b[0] for _, b in moves], device=pool.device)
                ds = torch.tensor([b[1] for _, b in moves], device=pool.device)
                for t in pool.fields:
                    t[dp, ds] = t[sp, ss].clone()
                pool.k_group[dp, ds] = pool.k_group[sp, ss].clone()
                self.compaction_moves += len(moves)
            pos = [int(pool.slot_pos[p, s]) for p, s in src]
            segs = [int(pool.slot_seg[p, s]) for p, s in src]
            keep_pages = pages[: (len(src) + pool.B - 1) // pool.B]
            for p in pages:
                pool.valid[p] = 0
                pool.live[p] = 0
                pool.hwm[p] = 0
                pool.slot_pos[p] = -1
                pool.slot_seg[p] = -1
            for i, ((p, s), q) in enumerate(zip(dst, pos)):
                pool.valid[p] |= np.int32(1 << s)
                pool.live[p] += 1
                pool.hwm[p] = max(pool.hwm[p], s + 1)
                pool.slot_pos[p, s] = q
                pool.slot_seg[p, s] = segs[i]
                table.loc[q] = (cls[0], p, s)
            pool._valid_dirty = True
            for p in pages[len(keep_pages):]:
                del table.page_seq[(cls[0], p)]
                pool.release_page(p)
                seq.add_bytes(-(pool.page_bytes + 4))
            table.pages[cls] = list(keep_pages)
            table.reusable[cls] = []
            table.open_page.pop(cls, None)
            if keep_pages and pool.hwm[keep_pages[-1]] < pool.B:
                table.open_page[cls] = keep_pages[-1]
            table._flat = table._bt = None

    # --- reads ------------------------------------------------------------------------------
    def live_positions(self, seq: SeqKV, layer: int) -> np.ndarray:
        """Positions held in pages (not the residual buffer), ascending."""
        return np.fromiter(sorted(seq.layers[layer].loc), np.int64)

    def gather_kv(self, seq: SeqKV, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized fp32 ``k, v [m, H, D]`` of paged tokens (read-only; for selection, not compaction)."""
        loc = seq.layers[layer].loc
        out_k = torch.empty(len(positions), self.cfg.num_kv_heads, self.cfg.head_dim, device=self.cfg.device)
        out_v = torch.empty_like(out_k)
        by_fmt: dict[str, list[tuple[int, int, int]]] = {}
        for i, pos in enumerate(positions.tolist() if hasattr(positions, "tolist") else positions):
            fmt, p, s = loc[int(pos)]
            by_fmt.setdefault(fmt, []).append((i, p, s))
        for fmt, items in by_fmt.items():
            pool = self.pools[layer][fmt]
            idx = torch.tensor([i for i, _, _ in items], device=pool.device)
            pp = torch.tensor([p for _, p, _ in items], device=pool.device)
            ss = torch.tensor([s for _, _, s in items], device=pool.device)
            slot = {f.name: t[pp, ss] for f, t in zip(pool.slot_specs, pool.fields)}
            group = {}
            if pool.group_specs:
                gid = pool.k_group[pp, ss].long()
                group = {f.name: t[gid] for f, t in zip(pool.group_specs, pool.group_fields)}
            k, v = pool.fmt.decode(slot, group, self.layer_scales(layer, fmt))
            out_k[idx], out_v[idx] = k, v
        return out_k, out_v

    def block_tables(self, layer: int, seqs: list[SeqKV]) -> list[tuple[PagePool, torch.Tensor]]:
        """Per format used in this layer: ``(pool, block_table [b, P] int32, -1 padded)``."""
        out = []
        if len(seqs) == 1:  # no padding to do; the tensor is cached until the page list changes
            table = seqs[0].layers[layer]
            if table._bt is None:
                table._bt = [(self.pools[layer][fmt], torch.tensor([pages], dtype=torch.int32,
                                                                 device=self.pools[layer][fmt].device))
                             for fmt, pages in table.pages_of_format().items() if pages]  # (a format whose
                # pages were all released, e.g. a tree block re-stored and rebuilt, has no table)
            return table._bt
        per_seq = [s.layers[layer].pages_of_format() for s in seqs]
        for fmt, pool in self.pools[layer].items():
            rows = [d.get(fmt, ()) for d in per_seq]
            width = max((len(r) for r in rows), default=0)
            if width == 0:
                continue
            bt = np.full((len(seqs), width), -1, np.int32)
            for i, r in enumerate(rows):
                bt[i, : len(r)] = r
            out.append((pool, torch.from_numpy(bt).to(pool.device)))
        return out

    def dense_run(self, layer: int, seqs: list[SeqKV]) -> tuple[int, int] | None:
        """``(first page, live tokens)`` when a lone request's tokens fill one ascending run of pages from
        its first slot with no hole — then attention can read a view of the pool instead of a gather."""
        if len(seqs) != 1:
            return None
        table = seqs[0].layers[layer]
        if table.holes or len(table.pages) != 1:
            return None
        (pages,) = table.pages.values()
        if not pages or pages[-1] - pages[0] != len(pages) - 1 or any(b - a != 1 for a, b in zip(pages, pages[1:])):
            return None
        return pages[0], table.live

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
        return sum(p.allocated_bytes() for pools in self.pools for p in pools.values())


def fp16_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """What an uncompressed fp16 cache holds per token (the ``kv_bytes_full`` reference)."""
    return num_layers * 2 * num_kv_heads * head_dim * 2


def format_of(name: str) -> KVFormat:
    return get_format(name)
