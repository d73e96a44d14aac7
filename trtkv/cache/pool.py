"""One page pool: the pages of one KV format in one layer, shared by all requests.

Pages hold ``block_size`` slots. Host-side metadata (numpy) is authoritative; the per-page validity
words are mirrored to the device for the attention kernel (on CPU the mirror *is* the host array).

A pool is allocated once, at its full size (``trtkv/cache/budget.py`` decides the size), and never grows:
a full pool raises ``OutOfKVMemory``. Its tensors come from ``host_empty`` (``torch.empty``, large CPU ones on
huge pages: trtkv/cache/host_memory.py) and are initialised before first use: the pages admission reserved for
the running requests at admission (``prepare``), any others a chunk at a time as they are handed out (pages and
groups are handed out lowest-first, so the reserved ones are those the requests can use). On CPU the memory of
pages never reserved is never touched, and a decode step does not pay for touching memory first (~0.5 GB/s on a
VM: a full cache at 32 layers x 256 requests spent ~3 ms a step on it).
"""
from __future__ import annotations

import heapq
from functools import cached_property

import numpy as np
import torch

from plugins import ops as plugin_ops
from plugins.formats import KVFormat
from trtkv.cache.host_memory import host_empty
from trtkv.cache.index_ops import add_at, clear_at, max_at, or_at
from trtkv.errors import OutOfKVMemory

FIRST_CHUNK = 16  # pages (or groups) initialised at once the first time; later chunks double
AHEAD_MAX = 256  # at most this many beyond those asked for: touching memory first is the cost, so none is early
POP_SORTED_MIN = 16  # free pages taken at once from which alloc_pages sorts the free heap instead of popping
MAX_POOL_PAGES = 1 << 23  # page ids a position map entry can name (trtkv/cache/columns.py)
MARK_MANY_MIN = 8  # slots written in one call from which mark_written uses array operations


class PagePool:
    """``growable``: double the pages (and groups) when full instead of raising — the host tiers' pools
    (``TierStore.host``), whose memory is host RAM capped in bytes elsewhere; ``pin``: keep the
    tensors in pinned host memory (asynchronous copies to a GPU)."""

    def __init__(self, fmt: KVFormat, num_heads: int, head_dim: int, block_size: int, device: str,
                 pages: int, groups: int = 0, growable: bool = False, pin: bool = False, slot_state=None):
        # Pools are made lazily, sometimes inside a decode step's inference mode; their tensors must stay
        # normal tensors so cache writes outside inference mode (tree search, tools) may update them.
        assert not (growable and slot_state is not None), "a growable pool owns its slot state"
        self.growable, self.pin = growable, pin
        with torch.inference_mode(False):
            self._setup(fmt, num_heads, head_dim, block_size, device, pages, groups, slot_state)
        self._pin_all()

    def _setup(self, fmt: KVFormat, num_heads: int, head_dim: int, block_size: int, device: str,
               pages: int, groups: int = 0, slot_state=None) -> None:
        """``slot_state``: views ``(valid, live, hwm, slot_pos, slot_seg, page_class)`` of this layer's row of a
        ``SlotStack`` (zeroed), when the pool's slot state is stacked with the other layers'
        (``trtkv/cache/pool_stack.py``)."""
        assert block_size <= 31, "validity words are int32 bit masks"
        assert 1 <= pages < MAX_POOL_PAGES, "a pool holds at least one page, and fewer than a position map can name"
        self.fmt, self.H, self.D, self.B, self.device = fmt, num_heads, head_dim, block_size, torch.device(device)
        cap = pages
        self.slot_specs = fmt.slot_fields(num_heads, head_dim)
        self.group_specs = fmt.group_fields(num_heads, head_dim)
        # (a growable pool keeps small pages: it grows by copying into fresh memory, whose first touch on huge
        # pages costs more than it saves — 2 MiB zeroed at a fault, compaction to find them)
        huge = not self.growable
        self.fields = [host_empty((cap, block_size, *f.shape), f.dtype, self.device, huge) for f in self.slot_specs]
        self.k_group = host_empty((cap, block_size), torch.int32, self.device, huge)
        if slot_state is not None:
            self.valid, self.live, self.hwm, self.slot_pos, self.slot_seg, self.page_class = slot_state
            assert self.valid.shape == (cap,) and self.slot_pos.shape == (cap, block_size)
        else:
            self.valid = np.zeros(cap, np.int32)  # bit s set = slot s holds a live token
            self.live = np.zeros(cap, np.int32)  # popcount(valid)
            self.hwm = np.zeros(cap, np.int32)  # slots [0, hwm) were written at least once
            self.slot_pos = np.empty((cap, block_size), np.int64)  # token position in each slot (-1 free)
            self.slot_seg = np.empty((cap, block_size), np.int32)  # policy segment id (ThinKV), -1 free
            self.page_class = np.zeros(cap, np.int32)  # thought type the page is dedicated to
        # whether a slot ever held a segment id: until then every slot's is -1, so freeing a slot need not write it
        self.segments = False
        self.free: list[int] = []  # min-heap of released pages; pages >= fresh were never handed out
        self.fresh = 0
        self.ready = 0  # pages [0, ready) are initialised (zero codes, k_group -1, no positions)
        self.in_use = 0
        self.peak_in_use = 0
        # key-scale arena (per flush group), refcounted by the slots that point at it
        gcap = groups if self.group_specs else 0
        self.group_fields = [host_empty((gcap, *f.shape), f.dtype, self.device, huge) for f in self.group_specs]
        self.group_ref = np.zeros(gcap, np.int32)
        self.group_free: list[int] = []  # released groups, reused last-released first
        self.group_fresh = 0
        self.groups_ready = 0
        self.peak_groups = 0
        if gcap:
            self._init_groups(1)  # padding slots (k_group -1) read group 0: keep it finite
        self._init_pages(1)  # padded block-table entries (-1) read page 0, even before any page is handed out
        self._valid_dev: torch.Tensor | None = None
        self._valid_src: np.ndarray | None = None  # (CPU) the array _valid_dev views
        if self.device.type != "cpu":
            self._valid_dev = torch.zeros(cap, dtype=torch.int32, device=self.device)
        self._valid_dirty = True

    # --- capacity ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self.valid)

    @property
    def group_capacity(self) -> int:
        return len(self.group_ref)

    @property
    def free_pages(self) -> int:
        return self.capacity - self.in_use

    def is_free(self, p: int) -> bool:
        return p >= self.fresh or p in self.free

    def _full(self) -> OutOfKVMemory:
        return OutOfKVMemory(f"the {self.fmt.name} KV pool is full ({self.capacity} pages of {self.B} slots per "
                             f"layer); raise --kv-memory (or --set max_pages) or lower the batch size")

    def prepare(self, pages: int, groups: int) -> None:
        """Initialise the first ``pages`` pages and ``groups`` groups now (at most the capacity), so that handing
        them out later touches no fresh memory: admission calls this with what its running requests reserved
        (pages and groups are handed out lowest-first, so those are the ones they can use)."""
        if self.growable:
            return
        if pages > self.ready:
            self._init_page_range(min(self.capacity, pages))
        if groups > self.groups_ready:
            self._init_group_range(min(self.group_capacity, groups))

    def _init_pages(self, upto: int) -> None:
        """Initialise pages ``[ready, upto)`` (and a doubling chunk beyond, at most AHEAD_MAX) before first use."""
        self._init_page_range(min(self.capacity, max(upto, min(2 * self.ready, upto + AHEAD_MAX), FIRST_CHUNK)))

    def _init_page_range(self, end: int) -> None:
        lo = self.ready
        for t in self.fields:
            t[lo:end].zero_()
        self.k_group[lo:end].fill_(-1)
        self.slot_pos[lo:end] = -1
        self.slot_seg[lo:end] = -1
        self.ready = end

    def _init_groups(self, upto: int) -> None:
        self._init_group_range(
            min(self.group_capacity, max(upto, min(2 * self.groups_ready, upto + AHEAD_MAX), FIRST_CHUNK)))

    def _init_group_range(self, end: int) -> None:
        for t in self.group_fields:
            t[self.groups_ready:end].zero_()
        self.groups_ready = end

    def alloc_page(self, page_class: int) -> int:
        if self.growable and not self.free and self.fresh >= self.capacity:
            self._grow_pages()
        if self.free:
            p = heapq.heappop(self.free)
        elif self.fresh < self.capacity:
            p = self.fresh
            self.fresh += 1
            if p >= self.ready:
                self._init_pages(p + 1)
        else:
            raise self._full()
        self.valid[p] = 0
        self.live[p] = 0
        self.hwm[p] = 0
        self.page_class[p] = page_class
        self.slot_pos[p] = -1
        self.slot_seg[p] = -1
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self._valid_dirty = True
        return p

    def alloc_pages(self, count: int, page_class: int) -> np.ndarray | None:
        """``count`` pages at once, the same ones ``count`` calls of ``alloc_page`` would hand out, in that
        order (a growable pool grows as those calls would); None (nothing allocated) when the pool lacks them."""
        if count > self.free_pages:
            if not self.growable:
                return None
            while count > self.free_pages:
                self._grow_pages()
        k = min(count, len(self.free))
        if k > POP_SORTED_MIN:  # the k lowest by one sort (in C); the sorted rest is still a heap
            self.free.sort()
            reused = self.free[:k]
            del self.free[:k]
        else:
            reused = [heapq.heappop(self.free) for _ in range(k)]
        fresh = np.arange(self.fresh, self.fresh + count - len(reused), dtype=np.int64)
        if len(fresh):
            self.fresh += len(fresh)
            if self.fresh > self.ready:
                self._init_pages(self.fresh)
        ps = np.concatenate([np.asarray(reused, np.int64), fresh])
        self.valid[ps] = 0
        self.live[ps] = 0
        self.hwm[ps] = 0
        self.page_class[ps] = page_class
        self.slot_pos[ps] = -1
        self.slot_seg[ps] = -1
        self.in_use += count
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self._valid_dirty = True
        return ps

    def release_page(self, p: int) -> None:
        assert self.live[p] == 0, "releasing a page that still holds live tokens"
        self.valid[p] = 0
        self.hwm[p] = 0
        heapq.heappush(self.free, p)
        self.in_use -= 1
        self._valid_dirty = True

    def release_pages(self, pages: np.ndarray) -> None:
        """``release_page`` of each of ``pages`` (distinct)."""
        if not len(pages):
            return
        assert not self.live[pages].any(), "releasing a page that still holds live tokens"
        self.valid[pages] = 0
        self.hwm[pages] = 0
        if len(pages) * 16 < len(self.free):  # a request's few pages into a large heap: pushes, not a rebuild
            for p in pages.tolist():
                heapq.heappush(self.free, p)
        else:
            self.free.extend(pages.tolist())
            heapq.heapify(self.free)
        self.in_use -= len(pages)
        self._valid_dirty = True

    # --- key-scale arena --------------------------------------------------------------------
    def alloc_group(self, refs: int) -> int:
        if not self.group_specs:
            return -1
        if self.growable and not self.group_free and self.group_fresh >= self.group_capacity:
            self._grow_groups()
        if self.group_free:
            g = self.group_free.pop()
        elif self.group_fresh < self.group_capacity:
            g = self.group_fresh
            self.group_fresh += 1
            if g >= self.groups_ready:
                self._init_groups(g + 1)
        else:
            raise OutOfKVMemory(f"the {self.fmt.name} key-scale arena is full ({self.group_capacity} groups per "
                                f"layer); raise --kv-memory or lower the batch size")
        self.group_ref[g] = refs
        self.peak_groups = max(self.peak_groups, self.groups_in_use)
        return g

    def alloc_groups(self, count: int, refs: int) -> np.ndarray | None:
        """``count`` arena entries of ``refs`` references each, the ids ``count`` calls of ``alloc_group`` hand out,
        in that order (-1 each without an arena); None (nothing taken) when the arena lacks them or would grow."""
        if not self.group_specs:
            return np.full(count, -1, np.int64)
        reused = min(count, len(self.group_free))
        if self.group_fresh + count - reused > self.group_capacity:
            return None
        got = np.empty(count, np.int64)
        if reused:
            got[:reused] = self.group_free[::-1][:reused]
            del self.group_free[len(self.group_free) - reused:]
        got[reused:] = np.arange(self.group_fresh, self.group_fresh + count - reused)
        self.group_fresh += count - reused
        if self.group_fresh > self.groups_ready:
            self._init_groups(self.group_fresh)
        self.group_ref[got] = refs
        self.peak_groups = max(self.peak_groups, self.groups_in_use)
        return got

    def decref_group(self, g: int, n: int = 1) -> bool:
        """Drop ``n`` references; True when the group's arena entry was freed."""
        if g < 0:
            return False
        self.group_ref[g] -= n
        assert self.group_ref[g] >= 0, "key-scale arena refcount below zero"
        if self.group_ref[g] == 0:
            self.group_free.append(g)
            return True
        return False

    def decref_groups_ordered(self, groups: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Drop ``counts[i]`` references of ``groups[i]`` (distinct), freeing emptied groups in the given
        order; returns which were freed."""
        ref = self.group_ref
        ref[groups] -= counts
        assert (ref[groups] >= 0).all(), "key-scale arena refcount below zero"
        freed = ref[groups] == 0
        self.group_free.extend(groups[freed].tolist())
        return freed

    @property
    def groups_in_use(self) -> int:
        return self.group_fresh - len(self.group_free)

    # --- slot state -------------------------------------------------------------------------
    def slot_free(self, p: int, s: int) -> bool:
        return not self.valid.item(p) >> s & 1

    def slots_free(self, _layers, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether slot ``slots[i]`` of page ``pages[i]`` holds no live token (``ReusableSlots``' check; this pool
        is one layer's, ``_layers`` says which)."""
        return (self.valid[pages] >> np.asarray(slots, np.int32)) & 1 == 0

    def take_tail(self, p: int, want: int) -> tuple[int, int]:
        """Up to ``want`` never-written tail slots of page ``p``: ``(first slot, count)``."""
        start = int(self.hwm[p])
        take = min(self.B - start, want)
        self.hwm[p] = start + take
        return start, take

    def take_tails(self, pages: np.ndarray) -> np.ndarray:
        """``take_tail(p, 1)`` of each of ``pages`` (distinct, each with a free tail slot): their first slots."""
        start = self.hwm[pages]
        assert (start < self.B).all(), "an open page without a tail slot"
        self.hwm[pages] = start + 1
        return start.astype(np.int64)

    def tail_full(self, p: int) -> bool:
        """Every slot of page ``p`` was written at least once."""
        return self.hwm[p] >= self.B

    def mark_full(self, pages: np.ndarray) -> None:
        """Pages about to be written whole (their tails are taken)."""
        self.hwm[pages] = self.B

    def mark_written(self, pages: list[int], slots: list[int], positions: list[int],
                     seg: int | np.ndarray = -1) -> None:
        """Distinct ``(page, slot)`` pairs now hold the tokens at ``positions`` (of segment ``seg``: one for all,
        or one per token)."""
        if len(pages) >= MARK_MANY_MIN or isinstance(seg, np.ndarray):  # array operations beat the per-slot loop
            pg, sl = np.asarray(pages, np.int64), np.asarray(slots, np.int64)
            bits = np.left_shift(np.int32(1), sl.astype(np.int32))
            assert not (self.valid[pg] & bits).any(), "writing into a live slot"
            or_at(self.valid, pg, bits)
            add_at(self.live, pg, 1)
            max_at(self.hwm, pg, (sl + 1).astype(np.int32))
            self.slot_pos[pg, sl] = positions
            self.slot_seg[pg, sl] = seg
            self._note_segments(seg)
            self._valid_dirty = True
            return
        valid, live, hwm = self.valid, self.live, self.hwm
        for p, s, pos in zip(pages, slots, positions):
            bit = 1 << s
            v = int(valid[p])
            assert not v & bit, "writing into a live slot"
            valid[p] = v | bit
            live[p] += 1
            if s >= hwm[p]:
                hwm[p] = s + 1
            self.slot_pos[p, s] = pos
            self.slot_seg[p, s] = seg
        self._note_segments(seg)
        self._valid_dirty = True

    def mark_pages_written(self, pages: np.ndarray, positions: np.ndarray, seg: int | np.ndarray = -1) -> None:
        """``mark_written`` of every slot of ``pages`` (distinct, none live, tails taken: ``mark_full``): slot ``s`` of
        ``pages[i]`` holds ``positions[i, s]`` (of segment ``seg``, one for all or ``[len(pages), B]``). A flush of
        whole fresh pages: a row a page instead of ``mark_written``'s accumulations over every slot."""
        assert not self.valid[pages].any(), "writing into a live slot"
        self.valid[pages] = self._all_slots
        self.live[pages] += self.B
        self.slot_pos[pages] = positions
        self.slot_seg[pages] = seg
        self._note_segments(seg)
        self._valid_dirty = True

    def _note_segments(self, seg: int | np.ndarray) -> None:
        if not self.segments and (np.any(seg >= 0) if isinstance(seg, np.ndarray) else seg >= 0):
            self.segments = True

    @cached_property
    def _all_slots(self) -> np.int32:
        """The validity word of a page whose every slot is live (bit ``B - 1`` is the sign bit when ``B`` is 32)."""
        return np.bitwise_or.reduce(np.left_shift(np.int32(1), np.arange(self.B, dtype=np.int32)))

    def mark_written_distinct(self, pages: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
        """``mark_written`` of one slot in each of ``pages`` (distinct; segment -1): plain fancy indexing (a
        decode step's write-through, one slot per request)."""
        bits = np.left_shift(1, slots)
        v = self.valid[pages]
        assert not (v & bits).any(), "writing into a live slot"
        self.valid[pages] = v | bits
        self.live[pages] += 1
        self.slot_pos[pages, slots] = positions
        self._valid_dirty = True  # (hwm: the slots came from take_tail or reuse; slot_seg of a free slot is -1)

    def note_valid_changed(self) -> None:
        """Validity words changed outside this pool's verbs (its ``SlotStack``'s): the device mirror is stale."""
        self._valid_dirty = True

    def mark_evicted(self, p: int, s: int) -> None:
        bit, v = 1 << s, int(self.valid[p])  # Python ints: bit <= 30 (block_size <= 31)
        assert v & bit, "evicting a slot that is not live"
        self.valid[p] = v ^ bit
        self.live[p] -= 1
        self.slot_pos[p, s] = -1
        self.slot_seg[p, s] = -1
        self._valid_dirty = True

    def clear_page(self, p: int | np.ndarray) -> None:
        """``mark_evicted`` of every live slot of page ``p`` (or of several pages) at once."""
        self.valid[p] = 0
        self.live[p] = 0
        self.slot_pos[p] = -1
        self.slot_seg[p] = -1
        self._valid_dirty = True

    def key_groups(self, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The key-scale group of each ``(pages[i], slots[i])`` (-1: none), on the host."""
        kg = self.k_group
        if kg.device.type == "cpu":
            return kg.numpy()[pages, slots]
        return kg[torch.from_numpy(pages).to(kg.device), torch.from_numpy(slots).to(kg.device)].cpu().numpy()

    def live_slots(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(pages, slots)`` of every live slot of ``pages``, page by page, slots ascending."""
        at, slots = self._live_at(pages)
        return pages[at], slots

    def _live_at(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``live_slots`` as ``(index into pages, slot)``."""
        return np.nonzero((self.valid[pages][:, None] >> np.arange(self.B, dtype=np.int32)) & 1)

    def mark_evicted_many(self, pages: np.ndarray, slots: np.ndarray) -> None:
        """``mark_evicted`` of distinct live ``(page, slot)`` pairs, as array operations."""
        bits = np.left_shift(np.int32(1), slots.astype(np.int32))
        assert (self.valid[pages] & bits).all(), "evicting a slot that is not live"
        clear_at(self.valid, pages, bits)
        add_at(self.live, pages, -1)
        self.slot_pos[pages, slots] = -1
        if self.segments:
            self.slot_seg[pages, slots] = -1
        self._valid_dirty = True

    def mark_evicted_distinct(self, pages: np.ndarray, slots: np.ndarray) -> None:
        """``mark_evicted_many`` of one slot in each of ``pages`` (distinct): plain fancy indexing."""
        bits = np.left_shift(1, slots)
        v = self.valid[pages]
        assert (v & bits).all(), "evicting a slot that is not live"
        self.valid[pages] = v & ~bits
        self.live[pages] -= 1
        self.slot_pos[pages, slots] = -1
        if self.segments:
            self.slot_seg[pages, slots] = -1
        self._valid_dirty = True

    def copy_page(self, p: int) -> int:
        """A new page of ``p``'s class holding a copy of ``p`` (codes, key-group ids, metadata); each live
        slot of the copy holds one more reference to its key-scale group (copy-on-write of a shared page)."""
        q = self.alloc_page(int(self.page_class[p]))
        for t in self.fields:
            t[q] = t[p]
        self.k_group[q] = self.k_group[p]
        self.valid[q], self.live[q], self.hwm[q] = self.valid[p], self.live[p], self.hwm[p]
        self.slot_pos[q], self.slot_seg[q] = self.slot_pos[p], self.slot_seg[p]
        if self.group_specs:
            for s in range(self.B):
                if self.valid[q] >> s & 1:
                    g = int(self.k_group[q, s])
                    if g >= 0:
                        self.group_ref[g] += 1
        self._valid_dirty = True
        return q

    def compact_pages_many(self, page_lists: list[list[int]]
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """Move the live slots of each of several disjoint page lists (in page, then slot order) to the front of
        that list, in one pass; returns their tokens' positions, new pages and slots concatenated list by list,
        how many each list keeps, and how many tokens' codes were copied in all. Pages past each list's live
        ones end empty (the caller releases them)."""
        lens = np.fromiter(map(len, page_lists), np.int64, len(page_lists))
        pg = np.concatenate(page_lists).astype(np.int64) if len(page_lists) > 1 else np.asarray(page_lists[0],
                                                                                                   np.int64)
        return self.compact_pages_flat(pg, lens)

    def compact_pages_flat(self, pg: np.ndarray, lens: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """``compact_pages_many`` of the lists concatenated: ``lens[j]`` of ``pg`` (int64) are list ``j``'s (the
        ``compact_slots`` plugin: codes and slot state in one pass)."""
        t = int(self.live[pg].sum())
        tokens, lists = np.empty((3, t), np.int64), np.empty(len(lens) + 1, np.int64)
        plugin_ops.compact_slots(self.fields, self.k_group, *map(torch.from_numpy, (
            self.valid, self.live, self.hwm, self.slot_pos, self.slot_seg, np.ascontiguousarray(pg, np.int64),
            np.ascontiguousarray(lens, np.int64), tokens, lists)))
        self._valid_dirty = True
        return tokens[0], tokens[1], tokens[2], lists[:-1], int(lists[-1])

    def valid_bits(self) -> torch.Tensor:
        """Device int32 ``[capacity]`` validity words for the attention kernel (on a GPU, a preallocated
        mirror refreshed over the pages handed out so far)."""
        if self.device.type == "cpu":  # a view of the host array (rebuilt if a host pool grew)
            if self._valid_src is not self.valid:
                self._valid_dev, self._valid_src = torch.from_numpy(self.valid), self.valid
            return self._valid_dev
        if self._valid_dirty:
            n = self.fresh
            self._valid_dev[:n].copy_(torch.from_numpy(self.valid[:n]), non_blocking=True)
            self._valid_dirty = False
        return self._valid_dev

    # --- bytes ------------------------------------------------------------------------------
    @cached_property  # constant per pool; read on every page allocation, release and eviction
    def page_bytes(self) -> int:
        """Codes and per-slot scales of one page, plus its metadata: validity word, class, and the
        per-slot key-group index where the format has a key-scale arena (what a request is charged)."""
        meta = 4 + 1 + (4 * self.B if self.group_specs else 0)
        return self.B * self.fmt.slot_bytes(self.H, self.D) + meta

    @cached_property
    def group_bytes(self) -> int:
        return self.fmt.group_bytes(self.H, self.D)

    def allocated_bytes(self) -> int:
        """Bytes the pool reserved (every page and group, used or not)."""
        return self.capacity * self.page_bytes + self.group_capacity * self.group_bytes

    def peak_bytes(self) -> int:
        """Bytes of the most pages and groups in use at once (what the workload actually needed)."""
        return self.peak_in_use * self.page_bytes + self.peak_groups * self.group_bytes

    # --- growth (host pools) ---------------------------------------------------------------------
    def _pin_all(self) -> None:
        if self.pin:
            self.fields = [t.pin_memory() for t in self.fields]
            self.k_group = self.k_group.pin_memory()
            self.group_fields = [t.pin_memory() for t in self.group_fields]

    def _grow_pages(self) -> None:
        """Double the pages; the new ones are initialised when first handed out. Copies host memory only."""
        pad = self.capacity
        assert 2 * pad < MAX_POOL_PAGES, "a host tier pool past the page ids a position map can name"
        self.fields = [_grown(t, 2 * pad) for t in self.fields]
        self.k_group = _grown(self.k_group, 2 * pad)
        self.valid = np.concatenate([self.valid, np.zeros(pad, np.int32)])
        self.live = np.concatenate([self.live, np.zeros(pad, np.int32)])
        self.hwm = np.concatenate([self.hwm, np.zeros(pad, np.int32)])
        self.slot_pos = np.concatenate([self.slot_pos, np.empty((pad, self.B), np.int64)])
        self.slot_seg = np.concatenate([self.slot_seg, np.empty((pad, self.B), np.int32)])
        self.page_class = np.concatenate([self.page_class, np.zeros(pad, np.int32)])
        self._valid_dirty = True
        self._pin_all()

    def _grow_groups(self) -> None:
        new = max(2 * self.group_capacity, 8)
        self.group_fields = [_grown(t, new) for t in self.group_fields]
        self.group_ref = np.concatenate([self.group_ref, np.zeros(new - len(self.group_ref), np.int32)])
        self._pin_all()


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with ``rows`` rows: its own first, the rest uninitialised."""
    out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:len(t)].copy_(t)
    return out
