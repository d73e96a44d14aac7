"""The host tiers' storage (T1/T2, ``trtkv/cache/tiers.py``): page pools in (pinned) host memory and the
``KVCacheManager`` that holds them.

Unlike the device pools, which are sized once (``trtkv/cache/budget.py``), host pools start small and double
when full. The host tiers' default is unbounded (``host_kv_memory`` unset) and a cap, when set, is enforced in
bytes by ``TierStore`` with undo, so a fixed size would either claim host RAM no run uses or refuse moves the
cap allows. Growth copies host memory only, at a tier move, never the device pools attention reads.
"""
from __future__ import annotations


import numpy as np
import torch

from plugins.formats import get_format
from trtkv.cache.manager import CacheConfig, KVCacheManager
from trtkv.cache.pool import PagePool


class HostPagePool(PagePool):
    """A page pool in host memory; pinned when the device is a GPU (so copies can be asynchronous)."""

    def __init__(self, fmt, num_heads: int, head_dim: int, block_size: int, pages: int, pin: bool = False):
        super().__init__(fmt, num_heads, head_dim, block_size, "cpu", pages, pages)
        self.pin = pin
        self._pin_all()

    def _pin_all(self) -> None:
        if self.pin:
            self.fields = [t.pin_memory() for t in self.fields]
            self.k_group = self.k_group.pin_memory()
            self.group_fields = [t.pin_memory() for t in self.group_fields]

    def alloc_page(self, page_class: int) -> int:
        if not self.free and self.fresh >= self.capacity:
            self._grow()
        return super().alloc_page(page_class)

    def alloc_group(self, refs: int) -> int:
        if self.group_specs and not self.group_free and self.group_fresh >= self.group_capacity:
            new = max(2 * self.group_capacity, 8)
            self.group_fields = [torch.cat([t, t.new_empty(new - len(t), *t.shape[1:])]) for t in self.group_fields]
            self.group_ref = np.concatenate([self.group_ref, np.zeros(new - len(self.group_ref), np.int32)])
            self._pin_all()
        return super().alloc_group(refs)

    def _grow(self) -> None:
        old = self.capacity
        pad = old  # double; the new pages are initialised when first handed out
        self.fields = [torch.cat([t, t.new_empty(pad, *t.shape[1:])]) for t in self.fields]
        self.k_group = torch.cat([self.k_group, self.k_group.new_empty((pad, self.B))])
        self.valid = np.concatenate([self.valid, np.zeros(pad, np.int32)])
        self.live = np.concatenate([self.live, np.zeros(pad, np.int32)])
        self.hwm = np.concatenate([self.hwm, np.zeros(pad, np.int32)])
        self.slot_pos = np.concatenate([self.slot_pos, np.empty((pad, self.B), np.int64)])
        self.slot_seg = np.concatenate([self.slot_seg, np.empty((pad, self.B), np.int32)])
        self.page_class = np.concatenate([self.page_class, np.zeros(pad, np.int32)])
        self._valid_dirty = True
        self._pin_all()


class HostKVStore(KVCacheManager):
    """The host tiers' pages: a ``KVCacheManager`` whose pools live in (pinned) host memory and grow."""

    def __init__(self, cfg: CacheConfig, kv_amax=None, pin: bool = False):
        super().__init__(cfg, kv_amax)
        self.pin = pin

    def pool(self, layer: int, fmt: str) -> PagePool:
        pools = self.pools[layer]
        if fmt not in pools:
            c = self.cfg
            pools[fmt] = HostPagePool(get_format(fmt), c.num_kv_heads, c.head_dim, c.block_size, c.initial_pages,
                                      self.pin)
        return pools[fmt]


__all__ = ["HostPagePool", "HostKVStore"]
