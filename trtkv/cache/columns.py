"""``TableColumns``: the per-token and per-class state of every request's block tables, as arrays with one
row per request.

A decode step writes one token of every request of the batch into every layer. Kept in one object per
(request, layer), that is Python work for requests × layers objects a step (8,192 at 32 layers × 256). Here
the position maps, live counts, open pages, reusable slots and page-list stamps of one layer are
columns indexed by the request's row, so a batch's write is a few array operations per layer.
``BlockTable`` still owns one request's paging rules and reaches its row only through the verbs here; the
batch verbs take an array of rows (distinct requests).

A position map entry packs ``(format, page, slot)`` into an int32: ``page << 8 | slot << 3 | format id``
(slots < 32: block sizes are <= 31; at most 8 formats; pages < 2**23 per pool); -1 is "not held".
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch

from plugins import ops as plugin_ops  # the ops' entry points; see plugins/ops.py
from trtkv.cache.fresh_pages import FreshPages
from trtkv.cache.leaving_pages import LeavingPages
from trtkv.cache.index_ops import add_at, split_counts
from trtkv.cache.page_changes import PageChanges
from trtkv.cache.pool_stack import flat
from trtkv.cache.reuse import Cls, ReusableSlots

Where = tuple[str, int, int]  # (format, page, slot)

NOT_HELD = -1
_SLOT_SHIFT, _PAGE_SHIFT = 3, 8
_FMT_MASK, _SLOT_MASK = 7, 31
MAX_FORMATS = 8
FIRST_ROWS, FIRST_WIDTH = 8, 64


class TableColumns:
    """Rows are handed out by ``acquire`` (lowest free first) and cleared by ``release``; each layer's position
    map is ``[rows, width]`` and widens (doubling) to the highest position written."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._rows = FIRST_ROWS
        # every layer's position map in one array [layers, rows, width], so a step's write of every layer is one
        # array operation (``place_rows_all``); ``_where[layer]`` is a view of one layer's map
        self._where = np.full((num_layers, FIRST_ROWS, FIRST_WIDTH), NOT_HELD, np.int32)
        self._live = np.zeros((num_layers, FIRST_ROWS), np.int64)
        # per class, [layers, rows] like ``_live``:
        self._open: dict[Cls, np.ndarray] = {}  # open page, -1 none
        self._holes = np.zeros((num_layers, FIRST_ROWS), bool)  # an eviction ever hit the table
        self._evicted = np.zeros(FIRST_ROWS, np.int64)  # tokens evicted per request, summed over layers
        self.changes = PageChanges(num_layers, FIRST_ROWS)  # page-list stamps, for the batch's block tables
        self._free = list(range(FIRST_ROWS - 1, -1, -1))  # a stack: the lowest free row on top
        self._fmt_ids: dict[str, int] = {}
        self._fmt_names: list[str] = []
        self.fresh = FreshPages(num_layers, FIRST_ROWS)  # a page boundary's pages, until each table reads its lists
        self.leaving = LeavingPages(num_layers, FIRST_ROWS)  # emptied pages, until each table reads its lists
        self.reuse = ReusableSlots(num_layers, FIRST_ROWS)  # evicted slots waiting to be written again

    # --- rows -------------------------------------------------------------------------------------
    def acquire(self) -> int:
        if not self._free:
            self._grow_rows()
        return self._free.pop()

    def release(self, row: int) -> None:
        """Row ``row`` holds nothing again (its request is freed)."""
        self._where[:, row] = NOT_HELD
        for col in self._open.values():
            col[:, row] = -1
        self._live[:, row] = 0
        self._holes[:, row] = False
        self._evicted[row] = 0
        self.changes.clear_row(row)
        self.fresh.clear_row(row)
        self.leaving.clear_row(row)
        self.reuse.clear_row(row)
        self._free.append(row)
        if len(self._free) > 1 and self._free[-1] > self._free[-2]:
            self._free.sort(reverse=True)

    def _grow_rows(self) -> None:
        old, new = self._rows, 2 * self._rows
        L, width = self.num_layers, self._where.shape[2]
        self._where = np.concatenate([self._where, np.full((L, new - old, width), NOT_HELD, np.int32)], axis=1)
        for cls, col in self._open.items():
            self._open[cls] = np.concatenate([col, np.full((L, new - old), -1, col.dtype)], axis=1)
        self._holes = np.concatenate([self._holes, np.zeros((self.num_layers, new - old), bool)], axis=1)
        self._evicted = np.concatenate([self._evicted, np.zeros(new - old, np.int64)])
        self._live = np.concatenate([self._live, np.zeros((self.num_layers, new - old), np.int64)], axis=1)
        self.changes.grow_rows(new)
        self.fresh.grow_rows(new)
        self.leaving.grow_rows(new)
        self.reuse.grow_rows(new)
        self._free = list(range(new - 1, old - 1, -1)) + self._free
        self._rows = new

    def _widen(self, layer: int, top: int) -> np.ndarray:
        """Layer ``layer``'s position map, at least ``top + 1`` positions wide (every layer's map widens)."""
        self._widen_all(top)
        return self._where[layer]

    def _widen_all(self, top: int) -> np.ndarray:
        w = self._where
        if top >= w.shape[2]:
            width = max(2 * w.shape[2], top + 1)
            grown = np.full((w.shape[0], w.shape[1], width), NOT_HELD, np.int32)
            grown[:, :, : w.shape[2]] = w
            self._where = w = grown
        return w

    # --- formats ----------------------------------------------------------------------------------
    def fmt_id(self, fmt: str) -> int:
        i = self._fmt_ids.get(fmt)
        if i is None:
            assert len(self._fmt_names) < MAX_FORMATS, "more KV formats than a position map entry can name"
            i = self._fmt_ids[fmt] = len(self._fmt_names)
            self._fmt_names.append(fmt)
        return i

    def _codes(self, fmt: str, pages, slots) -> np.ndarray:
        pages = np.asarray(pages, np.int64)  # (< 2**23: PagePool's MAX_POOL_PAGES)
        return ((pages << _PAGE_SHIFT) | (np.asarray(slots, np.int64) << _SLOT_SHIFT)
                | self.fmt_id(fmt)).astype(np.int32)

    def decode(self, code: int) -> Where:
        return self._fmt_names[code & _FMT_MASK], code >> _PAGE_SHIFT, (code >> _SLOT_SHIFT) & _SLOT_MASK

    def decode_many(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(format ids, pages, slots)`` of held entries."""
        codes = codes.astype(np.int64, copy=False)
        return codes & _FMT_MASK, codes >> _PAGE_SHIFT, (codes >> _SLOT_SHIFT) & _SLOT_MASK

    @property
    def fmt_names(self) -> tuple[str, ...]:
        return tuple(self._fmt_names)

    # --- the position map of one row ----------------------------------------------------------------
    def live(self, layer: int, row: int) -> int:
        return int(self._live[layer, row])

    def live_rows(self, layer: int, rows: np.ndarray) -> np.ndarray:
        return self._live[layer, rows]

    def live_rows_layers(self, rows: np.ndarray) -> np.ndarray:
        """``[L, len(rows)]`` paged tokens of ``rows`` in every layer (one read)."""
        return self._live[:, rows]

    def code(self, layer: int, row: int, pos: int) -> int:
        w = self._where[layer]
        return w.item(row, pos) if 0 <= pos < w.shape[1] else NOT_HELD

    def locate(self, layer: int, row: int, pos: int) -> Where | None:
        c = self.code(layer, row, pos)
        return None if c < 0 else self.decode(c)

    def positions(self, layer: int, row: int) -> np.ndarray:
        """Held positions, ascending."""
        return np.flatnonzero(self._where[layer][row] >= 0)

    def positions_rows(self, layer: int, rows: np.ndarray, n: int) -> np.ndarray:
        """``[len(rows), n]`` held positions, ascending, of ``rows`` that each hold exactly ``n``."""
        return _held_columns(self._where[layer:layer + 1], rows, n)[0]

    def positions_rows_all(self, rows: np.ndarray, n: int) -> np.ndarray:
        """``positions_rows`` of every layer: ``[layers, len(rows), n]``."""
        return _held_columns(self._where, rows, n)

    def positions_in(self, layer: int, row: int, lo: int, hi: int) -> np.ndarray:
        """Held positions in ``[lo, hi)``, ascending."""
        w = self._where[layer]
        lo, hi = max(lo, 0), min(hi, w.shape[1])
        if hi <= lo:
            return np.empty(0, np.int64)
        return np.flatnonzero(w[row, lo:hi] >= 0) + lo

    def positions_in_many(self, layer: int, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> list[np.ndarray]:
        """``positions_in`` of each ``(rows[i], lo[i], hi[i])``, by one read of the ranges side by side."""
        return split_counts(*self.positions_in_flat(layer, rows, lo, hi))

    def positions_in_flat(self, layer: int, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
        """``positions_in_many`` concatenated: ``(positions, counts)``, ``counts[i]`` of them the ``i``-th range's."""
        positions, counts = _held_in_ranges(self._where[layer:layer + 1], rows, lo, hi)
        return positions, counts[0]

    def positions_in_flat_layers(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray
                                 ) -> tuple[np.ndarray, np.ndarray]:
        """``positions_in_flat`` in every layer at once: ``(positions, counts [layers, len(rows)])``, the positions
        layer after layer, range after range."""
        return _held_in_ranges(self._where, rows, lo, hi)

    def held_many(self, layer: int, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Whether each ``(row, position)`` pair is held (in a page), as one array read."""
        w = self._where[layer]
        inside = (positions >= 0) & (positions < w.shape[1])
        held = np.zeros(len(positions), bool)
        held[inside] = w[rows[inside], positions[inside]] >= 0
        return held

    def lookup_many(self, layer: int, rows: np.ndarray, positions: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(format ids, pages, slots)`` of held ``(row, position)`` pairs; KeyError names a position not held."""
        return self.lookup_layers(layer, rows, positions)

    def lookup_layers(self, layers: int | np.ndarray, rows: np.ndarray, positions: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``lookup_many`` of pairs in several layers: ``positions[i]`` of row ``rows[i]`` in layer ``layers[i]`` (or
        all in ``layers``, an int)."""
        w = self._where
        inside = (positions >= 0) & (positions < w.shape[2])
        codes = np.full(len(positions), NOT_HELD, np.int64)
        codes[inside] = w[layers if np.ndim(layers) == 0 else layers[inside], rows[inside], positions[inside]]
        if (codes < 0).any():
            raise KeyError(int(positions[np.argmax(codes < 0)]))
        return self.decode_many(codes)

    def row_codes(self, layer: int, row: int) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, codes)`` of the held entries, ascending."""
        r = self._where[layer][row]
        pos = np.flatnonzero(r >= 0)
        return pos, r[pos]

    def place(self, layer: int, row: int, fmt: str, pages, slots, positions) -> None:
        """The tokens at ``positions`` (distinct) now live in ``(fmt, page, slot)``."""
        pos = np.asarray(positions, np.int64)
        if not len(pos):
            return
        w = self._widen(layer, int(pos.max()))
        new = int((w[row, pos] < 0).sum())
        w[row, pos] = self._codes(fmt, pages, slots)
        self._live[layer, row] += new

    def place_each(self, layer: int, rows: np.ndarray, fmt: str, pages: np.ndarray, slots: np.ndarray,
                   positions: np.ndarray) -> None:
        """``place`` of token ``i`` of row ``rows[i]`` (rows repeat; positions distinct within a row): a batch's
        compaction."""
        if not len(positions):
            return
        w = self._widen(layer, int(positions.max()))
        new = w[rows, positions] < 0
        w[rows, positions] = self._codes(fmt, pages, slots)
        add_at(self._live[layer], rows[new], 1)

    def place_one(self, layer: int, row: int, fmt: str, p: int, s: int, pos: int) -> None:
        w = self._widen(layer, pos)
        if w.item(row, pos) < 0:
            self._live[layer, row] += 1
        w[row, pos] = (p << _PAGE_SHIFT) | (s << _SLOT_SHIFT) | self.fmt_id(fmt)

    def place_rows(self, layer: int, rows: np.ndarray, fmt: str, pages: np.ndarray, slots: np.ndarray,
                   positions: np.ndarray) -> None:
        """One new token in each of ``rows`` (distinct; positions not yet held): a decode step's write."""
        w = self._widen(layer, int(positions.max()))
        w[rows, positions] = self._codes(fmt, pages, slots)
        self._live[layer, rows] += 1

    def place_rows_all(self, rows: np.ndarray, fmt: str, pages: np.ndarray, slots: np.ndarray,
                       positions: np.ndarray) -> None:
        """``place_rows`` in every layer at once: ``pages, slots [layers, len(rows)]``."""
        w = self._widen_all(int(positions.max()))
        L, R, W = w.shape
        flat(w)[(np.arange(0, L * R, R)[:, None] + rows[None, :]) * W + positions] = self._codes(fmt, pages, slots)
        self._live[:, rows] += 1

    def place_groups(self, layer: int, rows: np.ndarray, fmt: str, pages: np.ndarray, slots: np.ndarray,
                     positions: np.ndarray) -> None:
        """``place`` of ``positions [G, n]`` (distinct within a row) into ``(fmt, pages, slots) [G, n]`` for each
        of ``rows`` (distinct): a batch's flush of one group a request."""
        w = self._widen(layer, int(positions.max()))
        at = (rows[:, None], positions)
        self._live[layer, rows] += (w[at] < 0).sum(1)
        w[at] = self._codes(fmt, pages, slots)

    def place_flat(self, layer: int, rows: np.ndarray, fmt: str, pages: np.ndarray, slots: np.ndarray,
                   positions: np.ndarray) -> None:
        """``place`` of tokens of several rows at once: ``(rows[i], positions[i])`` pairs (distinct) into ``(fmt,
        pages[i], slots[i])``."""
        if not len(positions):
            return
        w = self._widen(layer, int(positions.max()))
        self._live[layer] += np.bincount(rows[w[rows, positions] < 0], minlength=w.shape[0])
        w[rows, positions] = self._codes(fmt, pages, slots)

    def forget(self, layer: int, row: int, positions) -> list[Where]:
        """Drop ``positions`` from the map; returns where the held ones were, in the order given."""
        pos = np.fromiter(positions, np.int64) if not isinstance(positions, np.ndarray) else \
            positions.astype(np.int64, copy=False)
        if not len(pos):
            return []
        w = self._where[layer]
        pos = pos[(pos >= 0) & (pos < w.shape[1])]
        if len(pos) > 1:  # a position listed twice is forgotten once
            _, first = np.unique(pos, return_index=True)
            if len(first) < len(pos):
                pos = pos[np.sort(first)]
        codes = w[row, pos]
        held = codes >= 0
        pos, codes = pos[held], codes[held]
        w[row, pos] = NOT_HELD
        self._live[layer, row] -= len(pos)
        fids, pages, slots = self.decode_many(codes)
        names = self._fmt_names
        return [(names[f], p, s) for f, p, s in zip(fids.tolist(), pages.tolist(), slots.tolist())]

    def forget_many(self, layer: int, rows: np.ndarray, positions: list[np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``forget`` of ``positions[i]`` from row ``rows[i]`` for every i, in one pass (a row may be listed more
        than once: a position is forgotten the first time it is listed): ``(item, format ids, pages, slots)``
        of the held ones, items ascending, each item's in the order given."""
        lens = np.fromiter(map(len, positions), np.int64, len(positions))
        pos = np.concatenate(positions) if len(positions) else np.empty(0, np.int64)
        return self.forget_flat(layer, rows, np.repeat(np.arange(len(positions)), lens), pos)

    def forget_flat(self, layer: int, rows: np.ndarray, item: np.ndarray, pos: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``forget_many`` with its positions concatenated: ``pos[k]`` of item ``item[k]`` (ascending)."""
        w = self._where[layer]
        inside = (pos >= 0) & (pos < w.shape[1])
        if not inside.all():
            item, pos = item[inside], pos[inside]
        row = rows[item]
        if len(pos) > 1:  # a (row, position) listed twice is forgotten once
            _, first = np.unique(row * w.shape[1] + pos, return_index=True)
            if len(first) < len(pos):
                first = np.sort(first)
                item, pos, row = item[first], pos[first], row[first]
        codes = w[row, pos]
        held = codes >= 0
        item, pos, row, codes = item[held], pos[held], row[held], codes[held]
        w[row, pos] = NOT_HELD
        add_at(self._live[layer], row, -1)
        self._holes[layer, rows] = True
        return (item, *self.decode_many(codes))

    def forget_rows(self, layer: int, rows: np.ndarray, positions: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``forget`` of one position in each of ``rows`` (distinct): ``(held, format ids, pages, slots)``, the
        last three for the held ones."""
        w = self._where[layer]
        inside = (positions >= 0) & (positions < w.shape[1])
        codes = np.full(len(rows), NOT_HELD, np.int64)
        codes[inside] = w[rows[inside], positions[inside]]
        held = codes >= 0
        w[rows[held], positions[held]] = NOT_HELD
        self._live[layer, rows[held]] -= 1
        self._holes[layer, rows] = True
        return (held, *self.decode_many(codes[held]))

    def forget_rows_all(self, layers: np.ndarray, rows: np.ndarray, positions: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``forget_rows`` in each of ``layers`` (distinct) at once: ``positions [len(layers), len(rows)]``, or ``[...,
        m]`` for ``m`` a row (distinct within a row; -1: none) -> ``(layer, item, format ids, pages, slots)`` of the
        held ones, in layer, item, then the row's order."""
        w = self._where
        L, R, W = w.shape
        pos = positions.reshape(len(layers), len(rows), -1)
        m = pos.shape[2]
        inside = (pos >= 0) & (pos < W)
        if inside.all():  # (every victim within the grid, the usual event: no compaction)
            n = len(rows)
            layer, j = np.repeat(layers, n * m), np.tile(np.repeat(np.arange(n), m), len(layers))
            at = ((layers[:, None, None] * R + rows[None, :, None]) * W + pos).reshape(-1)  # (pool_stack.flat)
        else:
            li, j, _ = np.nonzero(inside)
            layer = layers[li]
            at = (layer * R + rows[j]) * W + pos[inside]
        codes = flat(w)[at]
        held = codes >= 0
        if not held.all():
            layer, j, codes, at = layer[held], j[held], codes[held], at[held]
        flat(w)[at] = NOT_HELD
        if m == 1:  # (one victim a row: the cells are distinct)
            flat(self._live)[layer * self._live.shape[1] + rows[j]] -= 1
        else:
            add_at(flat(self._live), layer * self._live.shape[1] + rows[j], -1)
        if len(layers) == L:  # (ascending and distinct: every layer)
            self._holes[:, rows] = True
        else:
            self._holes[layers[:, None], rows[None, :]] = True
        return (layer, j, *self.decode_many(codes))

    def evicted(self, row: int) -> int:
        return int(self._evicted[row])

    def count_evicted(self, rows: np.ndarray, n) -> None:
        """``n`` (or ``n[i]``) more tokens evicted from each of ``rows`` (rows may repeat)."""
        add_at(self._evicted, rows, n)

    def holes(self, layer: int, row: int) -> bool:
        return bool(self._holes[layer, row])

    def set_holes(self, layer: int, row: int) -> None:
        self._holes[layer, row] = True

    def copy_row(self, layer: int, src: int, dst: int) -> None:
        w = self._where[layer]
        w[dst] = w[src]
        self._live[layer, dst] = self._live[layer, src]
        self.reuse.clear(layer, dst)

    # --- open pages --------------------------------------------------------------
    def _col(self, table: dict[Cls, np.ndarray], layer: int, cls: Cls, fill, dtype) -> np.ndarray:
        """Layer ``layer``'s column of ``cls`` (a view)."""
        return self._class_col(table, cls, fill, dtype)[layer]

    def _class_col(self, table: dict[Cls, np.ndarray], cls: Cls, fill, dtype) -> np.ndarray:
        """The ``[layers, rows]`` column of ``cls``, made for every layer at its first use."""
        col = table.get(cls)
        if col is None:
            col = table[cls] = np.full((self.num_layers, self._rows), fill, dtype)
        return col

    def open_page(self, layer: int, row: int, cls: Cls) -> int:
        col = self._open.get(cls)
        return -1 if col is None else col.item(layer, row)

    def set_open(self, layer: int, row: int, cls: Cls, p: int) -> None:
        self._col(self._open, layer, cls, -1, np.int64)[row] = p

    def set_opens(self, layer: int | np.ndarray, rows: np.ndarray, cls: Cls, pages: np.ndarray) -> None:
        """The open page of ``cls`` of row ``rows[i]`` in ``layer`` (or ``layer[i]``) is ``pages[i]`` (-1: none)."""
        self._class_col(self._open, cls, -1, np.int64)[layer, rows] = pages

    def open_pages_of(self, layer: int, row: int) -> dict[Cls, int]:
        return {cls: col.item(layer, row) for cls, col in self._open.items() if col.item(layer, row) >= 0}

    def close_all(self, layer: int, row: int) -> None:
        for col in self._open.values():
            col[layer, row] = -1

    def open_pages(self, layer: int, rows: np.ndarray, cls: Cls) -> np.ndarray:
        col = self._open.get(cls)
        return np.full(len(rows), -1, np.int64) if col is None else col[layer, rows]

    def open_pages_all(self, rows: np.ndarray, cls: Cls) -> np.ndarray:
        """``open_pages`` of every layer: ``[layers, len(rows)]``."""
        col = self._open.get(cls)
        return np.full((self.num_layers, len(rows)), -1, np.int64) if col is None else col[:, rows]

    def close_rows(self, layer: int, rows: np.ndarray, cls: Cls) -> None:
        self._open[cls][layer, rows] = -1

    def close_rows_all(self, rows: np.ndarray, cls: Cls, closed: np.ndarray) -> None:
        """``close_rows`` in every layer: ``rows[j]`` closes its open page of ``cls`` in layer l where
        ``closed[l, j]``."""
        layer, j = np.nonzero(closed)
        self._open[cls][layer, rows[j]] = -1


def _held_columns(where: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """The held columns, ascending, of rows ``rows`` of position maps ``where [layers, rows, width]`` that each hold
    exactly ``n``: ``[layers, len(rows), n]`` (``plugins/held_columns``: one scan of each row in place)."""
    return plugin_ops.held_columns(torch.from_numpy(where), torch.from_numpy(np.asarray(rows, np.int64)), n).numpy()


def _held_in_ranges(where: np.ndarray, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The held positions of ``[lo[i], hi[i])`` of each ``rows[i]`` in each layer of ``where [layers, rows, width]``:
    ``(positions, counts [layers, len(rows)])``, layer after layer, range after range (one read of the ranges side
    by side)."""
    lo, hi = np.clip(lo, 0, where.shape[2]), np.clip(hi, 0, where.shape[2])
    width = int((hi - lo).max(initial=0))
    if width <= 0:
        return np.empty(0, np.int64), np.zeros((where.shape[0], len(rows)), np.int64)
    cols = lo[:, None] + np.arange(width)
    held = (where[:, rows[:, None], np.minimum(cols, where.shape[2] - 1)] >= 0) & (cols < hi[:, None])
    at = np.flatnonzero(held)  # (one index array: a third of 3-D nonzero's time)
    return lo[at // width % len(rows)] + at % width, held.sum(2)


class PositionView(Mapping):
    """``position -> (format, page, slot)`` of one row, read-only, ascending positions."""

    __slots__ = ("_cols", "_layer", "_row")

    def __init__(self, cols: TableColumns, layer: int, row: int) -> None:
        self._cols, self._layer, self._row = cols, layer, row

    def __getitem__(self, pos) -> Where:
        c = self._cols.code(self._layer, self._row, int(pos))
        if c < 0:
            raise KeyError(pos)
        return self._cols.decode(c)

    def get(self, pos, default=None):
        c = self._cols.code(self._layer, self._row, int(pos))
        return default if c < 0 else self._cols.decode(c)

    def __contains__(self, pos) -> bool:
        return self._cols.code(self._layer, self._row, int(pos)) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._cols.positions(self._layer, self._row).tolist())

    def __len__(self) -> int:
        return self._cols.live(self._layer, self._row)

    def _decoded(self) -> tuple[list[int], list[Where]]:
        pos, codes = self._cols.row_codes(self._layer, self._row)
        fids, pages, slots = self._cols.decode_many(codes)
        names = self._cols.fmt_names
        return pos.tolist(), [(names[f], p, s) for f, p, s in zip(fids.tolist(), pages.tolist(), slots.tolist())]

    def values(self):
        return self._decoded()[1]

    def items(self):
        pos, where = self._decoded()
        return list(zip(pos, where))
