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
import torch

from plugins import ops as plugin_ops
from trtkv.cache.index_ops import add_at, clear_at

if TYPE_CHECKING:
    from trtkv.cache.pool import PagePool


def flat(a: np.ndarray) -> np.ndarray:
    """``a`` as a 1-D view (an error, never a copy, if it is not contiguous): a flat index costs a third of 2-D
    or 3-D fancy indexing's time."""
    v = a.view()
    v.shape = (-1,)
    return v


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
        at = self._page_index(self._layer if layers is None else layers, pages)
        hwm = flat(self.hwm)
        start = hwm[at]
        assert (start < self.B).all(), "an open page without a tail slot"
        hwm[at] = start + 1
        return start.astype(np.int64)

    def slots_free(self, layers: np.ndarray, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether slot ``slots[i]`` of page ``pages[i]`` in layer ``layers[i]`` holds no live token."""
        return (flat(self.valid)[self._page_index(layers, pages)] >> slots.astype(np.int32)) & 1 == 0

    def mark_written_distinct(self, pages: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
        """``PagePool.mark_written_distinct`` in every layer: one slot in each of ``pages [layers, n]`` now holds the
        token at ``positions[j]`` (the same position in every layer)."""
        at = self._page_index(self._layer, pages)
        bits = np.left_shift(1, slots)
        valid, live = flat(self.valid), flat(self.live)
        v = valid[at]
        assert not (v & bits).any(), "writing into a live slot"
        valid[at] = v | bits
        live[at] += 1
        flat(self.slot_pos)[at * self.B + slots] = np.broadcast_to(positions, at.shape)
        self._valid_changed()

    def mark_evicted_distinct(self, layers: np.ndarray, pages: np.ndarray, slots: np.ndarray) -> None:
        """``PagePool.mark_evicted_distinct`` of slot ``slots[i]`` of page ``pages[i]`` in layer ``layers[i]`` (pages
        distinct within a layer)."""
        at = self._page_index(layers, pages)
        bits = np.left_shift(1, slots)
        valid, live = flat(self.valid), flat(self.live)
        v = valid[at]
        assert (v & bits).all(), "evicting a slot that is not live"
        valid[at] = v & ~bits
        live[at] -= 1
        self._forget_slots(at, slots)

    def mark_evicted_many(self, layers: np.ndarray, pages: np.ndarray, slots: np.ndarray) -> None:
        """``mark_evicted_distinct`` where a page may lose several slots (distinct live ``(layer, page, slot)``)."""
        at = self._page_index(layers, pages)
        bits = np.left_shift(1, slots).astype(self.valid.dtype)
        valid, live = flat(self.valid), flat(self.live)
        assert (valid[at] & bits).all(), "evicting a slot that is not live"
        clear_at(valid, at, bits)
        add_at(live, at, -1)
        self._forget_slots(at, slots)

    def _forget_slots(self, at: np.ndarray, slots: np.ndarray) -> None:
        """Evicted slots ``slots`` of flat pages ``at`` hold no position (nor segment) any more."""
        at_slot = at * self.B + slots
        flat(self.slot_pos)[at_slot] = -1
        if any(pool.segments for pool in self._pools):  # (else every slot's segment is -1 already)
            flat(self.slot_seg)[at_slot] = -1
        self._valid_changed()

    def table_positions(self, tables: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """``table_positions`` of every layer in one read: ``tables[layer]`` is that layer's block table ``[b, P]``
        (-1 padded; one shape for every layer) -> positions ``[layers, b, P * B]`` and held counts ``[layers, b]``."""
        pos, counts = plugin_ops.table_positions_layers(torch.from_numpy(self.slot_pos), [t.cpu() for t in tables])
        return pos.numpy(), counts.numpy()

    def _page_index(self, layers: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Flat indices of ``(layers, pages)`` (broadcast) into the ``[layers, pages]`` arrays."""
        return layers * self.valid.shape[1] + pages

    def _valid_changed(self) -> None:
        for pool in self._pools:
            pool.note_valid_changed()
