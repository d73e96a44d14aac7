"""``SlotStack``: the host slot state of one format's page pools in every layer, stacked ``[layers, pages, ...]``.

A decode step writes one token of every request into every layer. Each layer's ``PagePool`` holds views of its
row here (validity words, live counts, tail marks, slot positions and segments, page classes) and changes them
through its own verbs; the verbs here change every layer's row at once, so the step's slot bookkeeping for all
layers is a few array operations instead of a few per layer (``KVCacheManager.plan_write_through``,
``evict_one_each_layers``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from trtkv.cache.pool import PagePool


class SlotStack:
    def __init__(self, num_layers: int, pages: int, block_size: int) -> None:
        self.B = block_size
        self.valid = np.zeros((num_layers, pages), np.int32)
        self.live = np.zeros((num_layers, pages), np.int32)
        self.hwm = np.zeros((num_layers, pages), np.int32)
        self.slot_pos = np.empty((num_layers, pages, block_size), np.int64)
        self.slot_seg = np.empty((num_layers, pages, block_size), np.int32)
        self.page_class = np.zeros((num_layers, pages), np.int32)
        self._layer = np.arange(num_layers)[:, None]
        self._pools: list[PagePool | None] = [None] * num_layers

    def rows(self, layer: int) -> tuple[np.ndarray, ...]:
        """Layer ``layer``'s views ``(valid, live, hwm, slot_pos, slot_seg, page_class)`` for its pool."""
        return (self.valid[layer], self.live[layer], self.hwm[layer], self.slot_pos[layer], self.slot_seg[layer],
                self.page_class[layer])

    def attach(self, layer: int, pool: PagePool) -> None:
        self._pools[layer] = pool

    @property
    def complete(self) -> bool:
        """Every layer's pool exists."""
        return all(p is not None for p in self._pools)

    def take_tails(self, pages: np.ndarray, layers: np.ndarray | None = None) -> np.ndarray:
        """``PagePool.take_tails`` in every layer: ``pages [layers, n]`` (distinct within a layer, each with a
        free tail slot) -> their first tail slots; with ``layers``, page ``pages[i]`` of layer ``layers[i]``."""
        at = (self._layer if layers is None else layers, pages)
        start = self.hwm[at]
        assert (start < self.B).all(), "an open page without a tail slot"
        self.hwm[at] = start + 1
        return start.astype(np.int64)

    def slots_free(self, layers: np.ndarray, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether slot ``slots[i]`` of page ``pages[i]`` in layer ``layers[i]`` holds no live token."""
        return (self.valid[layers, pages] >> slots.astype(np.int32)) & 1 == 0

    def mark_written_distinct(self, pages: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
        """``PagePool.mark_written_distinct`` in every layer: one slot in each of ``pages [layers, n]`` now holds the
        token at ``positions[j]`` (the same position in every layer)."""
        at = (self._layer, pages)
        bits = np.left_shift(1, slots)
        v = self.valid[at]
        assert not (v & bits).any(), "writing into a live slot"
        self.valid[at] = v | bits
        self.live[at] += 1
        self.slot_pos[self._layer, pages, slots] = positions
        self._valid_changed()

    def mark_evicted_distinct(self, layers: np.ndarray, pages: np.ndarray, slots: np.ndarray) -> None:
        """``PagePool.mark_evicted_distinct`` of slot ``slots[i]`` of page ``pages[i]`` in layer ``layers[i]`` (pages
        distinct within a layer)."""
        at = (layers, pages)
        bits = np.left_shift(1, slots)
        v = self.valid[at]
        assert (v & bits).all(), "evicting a slot that is not live"
        self.valid[at] = v & ~bits
        self.live[at] -= 1
        self.slot_pos[layers, pages, slots] = -1
        self.slot_seg[layers, pages, slots] = -1
        self._valid_changed()

    def _valid_changed(self) -> None:
        for pool in self._pools:
            pool.note_valid_changed()
