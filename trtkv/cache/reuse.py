"""``ReusableSlots``: every block table's evicted slots waiting to be written again, as arrays.

A table writes a new token into a reusable slot of its class before any tail slot, oldest page first (the
cache-wide order in which pages joined tables), lowest slot first. Kept as a Python heap per (request, layer,
class), a batch's eviction event pushes and a decode step pops request by request: 8,192 tables a step at
32 layers × 256. Here each class's reusable slots are one array ``[layers, rows, width]`` of sorted keys
``order << 31 | page << 5 | slot`` with a read head and an end per (layer, row): an event adds the victims of
every request of a layer in one sort, a step takes one slot for every (layer, request) in a few gathers.

A slot taken back is checked against the pool (an entry whose slot was written since is skipped and dropped);
a page leaving a table takes its entries with it (``drop_page``), so an entry always names a page its table
holds. The order number of every page handed to a table is kept here too (``note_orders``): the keys need it,
and pages shared by forked tables carry one number in all of them.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trtkv.cache.pool_stack import flat

Cls = tuple[str, int]  # (format name, thought class)
FreeCheck = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (layers, pages, slots) -> slot is free

_PAGE_SHIFT, _ORDER_SHIFT = 5, 31
_SLOT_MASK, _PAGE_MASK = 31, (1 << 26) - 1
_NONE = np.iinfo(np.int64).max  # past every key: the unused tail of a row
FIRST_WIDTH, FIRST_PAGES = 8, 64


def pack(orders: np.ndarray, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
    return (np.asarray(orders, np.int64) << _ORDER_SHIFT) | (np.asarray(pages, np.int64) << _PAGE_SHIFT) | slots


def unpack(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(orders, pages, slots)`` of ``keys``."""
    return keys >> _ORDER_SHIFT, (keys >> _PAGE_SHIFT) & _PAGE_MASK, keys & _SLOT_MASK


class ReusableSlots:
    """Per class, ``keys [layers, rows, width]`` sorted within ``[head, end)`` of each (layer, row)."""

    def __init__(self, num_layers: int, rows: int) -> None:
        self.num_layers, self._rows = num_layers, rows
        self._keys: dict[Cls, np.ndarray] = {}
        self._head: dict[Cls, np.ndarray] = {}
        self._end: dict[Cls, np.ndarray] = {}
        self._orders: dict[str, np.ndarray] = {}  # per format, [layers, pages]: each page's order number

    # --- rows -----------------------------------------------------------------------------------------
    def grow_rows(self, rows: int) -> None:
        extra = rows - self._rows
        for cls, keys in self._keys.items():
            L, _, W = keys.shape
            self._keys[cls] = np.concatenate([keys, np.full((L, extra, W), _NONE, np.int64)], axis=1)
            self._head[cls] = np.concatenate([self._head[cls], np.zeros((L, extra), np.int64)], axis=1)
            self._end[cls] = np.concatenate([self._end[cls], np.zeros((L, extra), np.int64)], axis=1)
        self._rows = rows

    def clear_row(self, row: int) -> None:
        """Nothing reusable for ``row`` in any layer (its request is freed)."""
        for cls in self._keys:
            self._head[cls][:, row] = self._end[cls][:, row] = 0

    def clear(self, layer: int, row: int | np.ndarray, cls: Cls | None = None) -> None:
        """Nothing reusable for ``row`` (or each of several rows) in ``layer``, of ``cls`` or of every class (a
        seal, a compaction)."""
        for c in ([cls] if cls is not None else list(self._keys)):
            if c in self._keys:
                self._head[c][layer, row] = self._end[c][layer, row] = 0

    # --- page order numbers ---------------------------------------------------------------------------
    def note_orders(self, layer, fmt: str, pages, orders) -> None:
        """Page ``pages[i]`` of ``fmt`` in layer ``layers[i]`` (or ``layer``) joined a table as ``orders[i]``."""
        arr = self._orders.get(fmt)
        top = int(np.max(pages)) if np.ndim(pages) else int(pages)
        if arr is None or top >= arr.shape[1]:
            width = max(FIRST_PAGES, top + 1, 0 if arr is None else 2 * arr.shape[1])
            grown = np.zeros((self.num_layers, width), np.int64)
            if arr is not None:
                grown[:, :arr.shape[1]] = arr
            self._orders[fmt] = arr = grown
        arr[layer, pages] = orders

    def orders_of(self, layer: int, fmt: str, pages) -> np.ndarray:
        """The order numbers of held pages ``pages`` of ``fmt`` in ``layer``."""
        return self._orders[fmt][layer, pages]

    # --- what is reusable ------------------------------------------------------------------------------
    def count(self, layer: int, row: int, cls: Cls) -> int:
        """Entries of ``row``'s ``cls`` in ``layer`` (slots written since they were freed included)."""
        head = self._head.get(cls)
        return 0 if head is None else self._end[cls].item(layer, row) - head.item(layer, row)

    def counts(self, layers, rows: np.ndarray, cls: Cls) -> np.ndarray | None:
        """``count`` of each of ``rows`` in ``layers`` (an int, an array like ``rows``, or a slice); None when no
        table ever had a reusable slot of ``cls``."""
        head = self._head.get(cls)
        return None if head is None else self._end[cls][layers, rows] - head[layers, rows]

    def entries(self, layer: int, row: int) -> dict[Cls, list[tuple[int, int, int]]]:
        """``class -> [(page order, page, slot), ...]`` of ``row`` in ``layer``, ascending (non-empty classes)."""
        out = {}
        for cls, keys in self._keys.items():
            h, e = self._head[cls].item(layer, row), self._end[cls].item(layer, row)
            if e > h:
                out[cls] = list(zip(*(a.tolist() for a in unpack(keys[layer, row, h:e]))))
        return out

    # --- adding ------------------------------------------------------------------------------------------
    def _class(self, cls: Cls) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if cls not in self._keys:
            self._keys[cls] = np.full((self.num_layers, self._rows, FIRST_WIDTH), _NONE, np.int64)
            self._head[cls] = np.zeros((self.num_layers, self._rows), np.int64)
            self._end[cls] = np.zeros((self.num_layers, self._rows), np.int64)
        return self._keys[cls], self._head[cls], self._end[cls]

    def _widen(self, cls: Cls, width: int) -> np.ndarray:
        keys = self._keys[cls]
        if width > keys.shape[2]:
            L, R, W = keys.shape
            grown = np.full((L, R, max(2 * W, width)), _NONE, np.int64)
            grown[:, :, :W] = keys
            self._keys[cls] = keys = grown
        return keys

    def push(self, layers, rows: np.ndarray, cls: Cls, pages: np.ndarray, slots: np.ndarray) -> None:
        """Slot ``slots[i]`` of page ``pages[i]`` is reusable by row ``rows[i]`` in layer ``layers[i]`` (``layers``
        an int or an array; (layer, row) pairs may repeat)."""
        if not len(rows):
            return
        orders = self._orders[cls[0]]
        keys_new = pack(flat(orders)[np.asarray(layers, np.int64) * orders.shape[1] + pages], pages, slots)
        keys, head, end = self._class(cls)
        lin = np.asarray(layers, np.int64) * self._rows + rows  # (layer, row) as a flat index (pool_stack.flat)
        if len(lin) > 1 and np.bincount(lin).max() == 1:  # one slot per (layer, row) (a step's one-token
            u, start, cnt = lin, np.arange(len(lin)), np.ones(len(lin), np.int64)  # evictions): no grouping
        else:  # grouped by (layer, row); each group's keys are sorted below, with its old ones
            order = np.argsort(lin, kind="stable")
            lin, keys_new = lin[order], keys_new[order]
            start = np.flatnonzero(np.concatenate([[True], lin[1:] != lin[:-1]]))
            u, cnt = lin[start], np.diff(np.append(start, len(lin)))
        heads, ends = flat(head), flat(end)
        h = heads[u]
        old = ends[u] - h
        total = old + cnt
        keys = self._widen(cls, int(total.max()))
        W = keys.shape[2]
        row_at = u[:, None] * W  # each (layer, row)'s first key in the flat keys
        mo, mc = int(old.max()), int(cnt.max())
        if mo == 0 and mc == 1:  # one key each into empty queues (a step's one-token evictions): nothing to merge
            flat(keys)[row_at[:, 0]] = keys_new
            heads[u] = 0
            ends[u] = 1
            return
        buf = np.full((len(u), mo + mc), _NONE, np.int64)
        if mo:
            j = np.arange(mo)
            at = np.minimum(h[:, None] + j, W - 1)
            buf[:, :mo] = np.where(j < old[:, None], flat(keys)[row_at + at], _NONE)
        grp = np.repeat(np.arange(len(u)), cnt)
        buf[grp, mo + np.arange(len(lin)) - np.repeat(start, cnt)] = keys_new
        buf.sort(axis=1)
        width = min(buf.shape[1], W)
        flat(keys)[row_at + np.arange(width)] = buf[:, :width]
        heads[u] = 0
        ends[u] = total

    def drop_page(self, layer: int, row: int, cls: Cls, page: int | list[int]) -> None:
        """``page`` (or several) left ``row``'s table in ``layer``: its entries go."""
        if cls not in self._keys:
            return
        keys, head, end = self._keys[cls], self._head[cls], self._end[cls]
        h, e = head.item(layer, row), end.item(layer, row)
        if e == h:
            return
        live = keys[layer, row, h:e]
        of = (live >> _PAGE_SHIFT) & _PAGE_MASK
        kept = live[~np.isin(of, page)] if isinstance(page, list) else live[of != page]
        if len(kept) < e - h:
            keys[layer, row, :len(kept)] = kept
            head[layer, row], end[layer, row] = 0, len(kept)

    def drop_pages_each(self, layer: int, rows: np.ndarray, cls: Cls, pages: np.ndarray, counts: np.ndarray) -> None:
        """``drop_page`` of ``counts[i]`` of ``pages`` (concatenated row by row) for each of ``rows`` (distinct)."""
        if cls not in self._keys or not len(rows):
            return
        keys, head, end = self._keys[cls], self._head[cls], self._end[cls]
        h, n = head[layer, rows], end[layer, rows] - head[layer, rows]
        W = int(n.max())
        if W == 0:
            return
        at = h[:, None] + np.arange(W)
        inside = np.arange(W) < n[:, None]
        k = keys[layer, rows[:, None], np.minimum(at, keys.shape[2] - 1)]
        of = (k >> _PAGE_SHIFT) & _PAGE_MASK
        place = np.arange(1, len(rows) + 1)
        owner = np.repeat(place, counts)  # each page's row, as its place among rows + 1
        mark = np.zeros(int(pages.max(initial=0)) + 1, np.int64)  # page -> the row dropping it (0: none)
        mark[pages] = owner
        if (mark[pages] == owner).all():  # (no page dropped by two rows: one lookup an entry)
            gone = inside & (of < len(mark)) & (mark[np.minimum(of, len(mark) - 1)] == place[:, None])
        else:
            span = _PAGE_MASK + 1
            gone = inside & np.isin(place[:, None] * span + of, owner * span + pages)
        hit = np.flatnonzero(gone.any(1))
        if not len(hit):
            return
        kept = inside[hit] & ~gone[hit]
        hr, col = np.nonzero(kept)  # each row's kept entries, in order, to its first places
        keys[layer, rows[hit][hr], (np.cumsum(kept, axis=1) - 1)[hr, col]] = k[hit][hr, col]
        head[layer, rows[hit]], end[layer, rows[hit]] = 0, kept.sum(1)

    # --- taking back ---------------------------------------------------------------------------------------
    def take(self, layer: int, row: int, cls: Cls, n: int, free: FreeCheck) -> tuple[list[int], list[int]]:
        """Up to ``n`` reusable slots of ``row`` in ``layer``, oldest page first: ``(pages, slots)``; entries whose
        slot is no longer free are dropped on the way (``free(layer, pages, slots)``)."""
        if n <= 0 or self.count(layer, row, cls) == 0:
            return [], []
        keys, head, end = self._keys[cls], self._head[cls], self._end[cls]
        h, e = head.item(layer, row), end.item(layer, row)
        _, p, s = unpack(keys[layer, row, h:e])
        ok = free(layer, p, s)
        idx = np.flatnonzero(ok)[:n]
        used = (int(idx[-1]) + 1) if len(idx) == n else e - h
        head[layer, row] = h + used
        return p[idx].tolist(), s[idx].tolist()

    def take_each(self, layer: int, rows: np.ndarray, cls: Cls, counts: np.ndarray, free: FreeCheck
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``take`` of up to ``counts[i]`` slots for each of ``rows`` (distinct) in ``layer``, by array operations:
        ``(pages, slots, got)``, every row's slots concatenated in row order, ``got[i]`` of them row ``i``'s."""
        n = len(rows)
        got = np.zeros(n, np.int64)
        if cls not in self._keys or not n:
            return np.empty(0, np.int64), np.empty(0, np.int64), got
        keys, head, end = self._keys[cls], self._head[cls], self._end[cls]
        h = head[layer, rows]
        width = np.where(counts > 0, end[layer, rows] - h, 0)
        if not width.any():
            return np.empty(0, np.int64), np.empty(0, np.int64), got
        row_of = np.repeat(np.arange(n), width)
        starts = np.cumsum(width) - width
        k = np.arange(int(width.sum())) - np.repeat(starts, width)  # each entry's place in its row's queue
        _, p, s = unpack(keys[layer, rows[row_of], h[row_of] + k])
        ok = free(layer, p, s)
        seen = np.cumsum(ok)  # free entries so far; a row's own rank subtracts those before the row
        before = np.concatenate([[0], seen])[starts]
        taken = ok & (seen - np.repeat(before, width) <= counts[row_of])
        got = np.bincount(row_of[taken], minlength=n).astype(np.int64)
        last = np.zeros(n, np.int64)
        np.maximum.at(last, row_of[taken], k[taken] + 1)
        # a row that got all it asked for stops after its last taken entry; else its whole queue was read
        head[layer, rows] = h + np.where((got == counts) & (counts > 0), last, width)
        return p[taken], s[taken], got

    def take_one_each(self, layers, rows: np.ndarray, cls: Cls, free: FreeCheck) -> tuple[np.ndarray, np.ndarray]:
        """One reusable slot for each (``layers[i]``, ``rows[i]``) pair (distinct; ``layers`` an int or an array):
        ``(pages, slots)``, page -1 where none is left."""
        n = len(rows)
        pages, slots = np.full(n, -1, np.int64), np.zeros(n, np.int64)
        if cls not in self._keys:
            return pages, slots
        keys, head, end = self._keys[cls], self._head[cls], self._end[cls]
        li = np.broadcast_to(np.asarray(layers, np.int64), (n,))
        # (layer, row) as one index into the flat views: one gather each instead of a 2-D fancy index
        at = li * self._rows + rows
        heads, ends, keys_flat, W = flat(head), flat(end), flat(keys), keys.shape[2]
        act = np.flatnonzero(ends[at] > heads[at])
        while len(act):
            fa = at[act]
            h = heads[fa]
            _, p, s = unpack(keys_flat[fa * W + h])
            heads[fa] = h + 1
            ok = free(li[act], p, s)
            pages[act[ok]], slots[act[ok]] = p[ok], s[ok]
            act = act[~ok]
            act = act[ends[at[act]] > heads[at[act]]]
        return pages, slots
