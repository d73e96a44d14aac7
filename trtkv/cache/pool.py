"""One page pool: the pages of one KV format in one layer, shared by all requests.

Pages hold ``block_size`` slots. Host-side metadata (numpy) is authoritative; the per-page validity
words are mirrored to the device for the attention kernel (on CPU the mirror *is* the host array).
"""
from __future__ import annotations

import heapq
from functools import cached_property

import numpy as np
import torch

from plugins.formats import KVFormat
from trtkv.errors import OutOfKVMemory


class PagePool:
    def __init__(self, fmt: KVFormat, num_heads: int, head_dim: int, block_size: int, device: str,
                 initial_pages: int = 8, max_pages: int | None = None):
        assert block_size <= 31, "validity words are int32 bit masks"
        self.fmt, self.H, self.D, self.B, self.device = fmt, num_heads, head_dim, block_size, torch.device(device)
        self.max_pages = max_pages
        cap = min(initial_pages, max_pages) if max_pages else initial_pages
        self.slot_specs = fmt.slot_fields(num_heads, head_dim)
        self.group_specs = fmt.group_fields(num_heads, head_dim)
        self.fields = [torch.zeros(cap, block_size, *f.shape, dtype=f.dtype, device=self.device)
                       for f in self.slot_specs]
        self.k_group = torch.full((cap, block_size), -1, dtype=torch.int32, device=self.device)
        self.valid = np.zeros(cap, np.int32)  # bit s set = slot s holds a live token
        self.live = np.zeros(cap, np.int32)  # popcount(valid)
        self.hwm = np.zeros(cap, np.int32)  # slots [0, hwm) were written at least once
        self.slot_pos = np.full((cap, block_size), -1, np.int64)  # token position in each slot (-1 free)
        self.slot_seg = np.full((cap, block_size), -1, np.int32)  # policy segment id (ThinKV), -1 free
        self.page_class = np.zeros(cap, np.int32)  # thought type the page is dedicated to
        self.free = list(range(cap))  # min-heap: the lowest free page first, so runs stay ascending
        self.in_use = 0
        # key-scale arena (per flush group), refcounted by the slots that point at it
        gcap = cap if self.group_specs else 0
        self.group_fields = [torch.zeros(gcap, *f.shape, dtype=f.dtype, device=self.device) for f in self.group_specs]
        self.group_ref = np.zeros(gcap, np.int32)
        self.group_free = list(range(gcap - 1, -1, -1))
        self._valid_dev: torch.Tensor | None = None
        self._valid_dirty = True

    # --- capacity ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self.valid)

    def _grow(self) -> None:
        old = self.capacity
        new = old * 2 if not self.max_pages else min(old * 2, self.max_pages)
        if new <= old:
            raise OutOfKVMemory(
                f"KV pool for {self.fmt.name} is full ({old} pages); raise --kv-memory or lower the batch size"
            )
        pad = new - old
        self.fields = [torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in self.fields]
        self.k_group = torch.cat([self.k_group, self.k_group.new_full((pad, self.B), -1)])
        self.valid = np.concatenate([self.valid, np.zeros(pad, np.int32)])
        self.live = np.concatenate([self.live, np.zeros(pad, np.int32)])
        self.hwm = np.concatenate([self.hwm, np.zeros(pad, np.int32)])
        self.slot_pos = np.concatenate([self.slot_pos, np.full((pad, self.B), -1, np.int64)])
        self.slot_seg = np.concatenate([self.slot_seg, np.full((pad, self.B), -1, np.int32)])
        self.page_class = np.concatenate([self.page_class, np.zeros(pad, np.int32)])
        for p in range(old, new):
            heapq.heappush(self.free, p)
        self._valid_dirty = True

    def alloc_page(self, page_class: int) -> int:
        if not self.free:
            self._grow()
        p = heapq.heappop(self.free)
        self.valid[p] = 0
        self.live[p] = 0
        self.hwm[p] = 0
        self.page_class[p] = page_class
        self.slot_pos[p] = -1
        self.slot_seg[p] = -1
        self.in_use += 1
        self._valid_dirty = True
        return p

    def release_page(self, p: int) -> None:
        assert self.live[p] == 0, "releasing a page that still holds live tokens"
        self.valid[p] = 0
        self.hwm[p] = 0
        heapq.heappush(self.free, p)
        self.in_use -= 1
        self._valid_dirty = True

    # --- key-scale arena --------------------------------------------------------------------
    def alloc_group(self, refs: int) -> int:
        if not self.group_specs:
            return -1
        if not self.group_free:
            old = len(self.group_ref)
            new = max(2 * old, 8)
            self.group_fields = [torch.cat([t, t.new_zeros(new - old, *t.shape[1:])]) for t in self.group_fields]
            self.group_ref = np.concatenate([self.group_ref, np.zeros(new - old, np.int32)])
            self.group_free = list(range(new - 1, old - 1, -1)) + self.group_free
        g = self.group_free.pop()
        self.group_ref[g] = refs
        return g

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

    @property
    def groups_in_use(self) -> int:
        return len(self.group_ref) - len(self.group_free)

    # --- slot state -------------------------------------------------------------------------
    def mark_written(self, pages: list[int], slots: list[int], positions: list[int], seg: int = -1) -> None:
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
        self._valid_dirty = True

    def mark_evicted(self, p: int, s: int) -> None:
        bit = np.int32(1 << s)
        assert self.valid[p] & bit, "evicting a slot that is not live"
        self.valid[p] &= ~bit
        self.live[p] -= 1
        self.slot_pos[p, s] = -1
        self.slot_seg[p, s] = -1
        self._valid_dirty = True

    def mark_evicted_many(self, pages: np.ndarray, slots: np.ndarray) -> None:
        """``mark_evicted`` of distinct live ``(page, slot)`` pairs, as array operations."""
        bits = np.left_shift(np.int32(1), slots.astype(np.int32))
        assert (self.valid[pages] & bits).all(), "evicting a slot that is not live"
        np.bitwise_and.at(self.valid, pages, ~bits)
        np.subtract.at(self.live, pages, 1)
        self.slot_pos[pages, slots] = -1
        self.slot_seg[pages, slots] = -1
        self._valid_dirty = True

    def valid_bits(self) -> torch.Tensor:
        """Device int32 ``[capacity]`` validity words for the attention kernel."""
        if self.device.type == "cpu":  # a view of the host array, rebuilt only when the array is replaced
            if self._valid_dev is None or self._valid_dev.data_ptr() != self.valid.ctypes.data:
                self._valid_dev = torch.from_numpy(self.valid)
            return self._valid_dev
        if self._valid_dirty or self._valid_dev is None or len(self._valid_dev) != self.capacity:
            self._valid_dev = torch.from_numpy(self.valid).to(self.device, non_blocking=True)
            self._valid_dirty = False
        return self._valid_dev

    # --- bytes ------------------------------------------------------------------------------
    @cached_property  # constant per pool; read on every page allocation, release and eviction
    def page_bytes(self) -> int:
        """Codes and per-slot scales of one page, plus its metadata: validity word, class, and the
        per-slot key-group index where the format has a key-scale arena."""
        meta = 4 + 1 + (4 * self.B if self.group_specs else 0)
        return self.B * self.fmt.slot_bytes(self.H, self.D) + meta

    @cached_property
    def group_bytes(self) -> int:
        return self.fmt.group_bytes(self.H, self.D)

    def allocated_bytes(self) -> int:
        return self.capacity * self.page_bytes + len(self.group_ref) * self.group_bytes
