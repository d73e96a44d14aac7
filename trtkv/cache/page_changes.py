"""``PageChanges``: which block tables' page lists changed, and how, so a batch's block tables follow them.

Every (layer, table row) has a stamp that moves whenever its page lists change; a batch's block tables
(``cache/reads.py``) remember the stamp of each row they last read and rewrite a row from its table's Python lists
when it moved. At 32 layers × 256 requests a page boundary or an eviction event changes 8,192 lists at once, and
rewriting each from Python is the cost. So the last ``DEPTH`` changes of a row are also recorded when they are ones a
block table can apply in place: up to ``CHANGE_MAX`` pages of one format that joined the end of its list (a page
boundary, a flush's group) or that left it (pages an eviction emptied, or a compaction cut), each with the stamp
before it. A block table that read the row at one of those stamps applies what followed by array operations (an
event's emptied pages, its compaction's cut ones and the next step's page boundary come between two reads); any
other change is a plain touch, which forgets them.
"""
from __future__ import annotations

import numpy as np

CHANGE_MAX = 8  # pages of one change a batch's block tables apply in place (more: the row is rewritten)
DEPTH = 3  # the last changes of a row kept for block tables that read it before them
_FMT_BITS, _FMT_MASK = 3, 7  # page << 3 | format id (a format id fits 3 bits)


class PageChanges:
    """Per layer and table row: the stamp, and the last ``DEPTH`` changes when block tables can apply them in
    place."""

    def __init__(self, num_layers: int, rows: int) -> None:
        self._stamp = np.zeros((num_layers, rows), np.int64)
        # a ring of DEPTH changes per (layer, row), ``_last`` at the newest: each the stamp before it, its pages
        # (page << 3 | format id, -1 padded; all -1: not recorded) and whether they left the list (else joined the
        # end of its format's); a new change overwrites the oldest in place
        self._before = np.zeros((DEPTH, num_layers, rows), np.int64)
        self._pages = np.full((DEPTH, num_layers, rows, CHANGE_MAX), -1, np.int64)
        self._removed = np.zeros((DEPTH, num_layers, rows), bool)
        self._last = np.zeros((num_layers, rows), np.int64)
        self._clock = 0
        self._layer_clock = np.zeros(num_layers, np.int64)  # the latest stamp handed out in each layer
        self._emptied = np.zeros(rows, np.int64)  # each row's stamp when it last held no pages (0: as made)

    def grow_rows(self, rows: int) -> None:
        old = self._stamp.shape[1]
        self._stamp, self._last = (np.concatenate([a, np.zeros((a.shape[0], rows - old), np.int64)], axis=1)
                                   for a in (self._stamp, self._last))
        self._emptied = np.concatenate([self._emptied, np.zeros(rows - old, np.int64)])
        self._before, self._removed = (np.concatenate([a, np.zeros((*a.shape[:2], rows - old), a.dtype)], axis=2)
                                       for a in (self._before, self._removed))
        self._pages = np.concatenate([self._pages, np.full((*self._pages.shape[:2], rows - old, CHANGE_MAX), -1,
                                                           np.int64)], axis=2)

    def clear_row(self, row: int) -> None:
        """Row ``row`` changed in every layer (its request was freed)."""
        self._clock += 1
        self._stamp[:, row] = self._clock
        self._layer_clock[:] = self._clock
        self._pages[:, :, row] = -1
        self._emptied[row] = self._clock

    def touch(self, layer: int, row: int) -> None:
        self.touch_rows(layer, np.array([row], np.int64))

    def touch_rows(self, layer: int, rows: np.ndarray) -> None:
        """The page lists of ``rows`` (distinct) changed in ``layer``, in a way not recorded."""
        self._stamp_rows(layer, rows)
        self._pages[:, layer, rows] = -1

    def _stamp_rows(self, layer: int, rows: np.ndarray) -> None:
        self._stamp[layer, rows] = self._clock + 1 + np.arange(len(rows))
        self._clock += len(rows)
        self._layer_clock[layer] = self._clock

    def append_rows(self, layer: int | np.ndarray, rows: np.ndarray, fmt_id: int, pages: np.ndarray,
                    at_end: np.ndarray) -> None:
        """``touch_rows`` for page ``pages[i]`` (``[n]``), or the pages ``pages[i]`` in order (``[n, m]``), joining
        row ``rows[i]``'s pages of format ``fmt_id`` in ``layer`` (or ``layer[i]``; pairs distinct), the last of
        that format's list where ``at_end[i]``."""
        pages = np.asarray(pages, np.int64)
        self._record(layer, rows, fmt_id, pages[:, None] if pages.ndim == 1 else pages, at_end, removed=False)

    def remove_rows(self, layer: int, rows: np.ndarray, fmt_id: int, pages: np.ndarray, counts: np.ndarray) -> None:
        """``touch_rows`` for ``counts[i]`` of ``pages`` (row by row) leaving row ``rows[i]``'s (distinct) pages of
        format ``fmt_id``."""
        width = int(counts.max(initial=0))
        grid = np.full((len(rows), max(width, 1)), -1, np.int64)
        starts = np.cumsum(counts) - counts
        grid[np.repeat(np.arange(len(rows)), counts), np.arange(len(pages)) - np.repeat(starts, counts)] = pages
        self._record(layer, rows, fmt_id, grid, np.ones(len(rows), bool), removed=True)

    def _record(self, layer: int, rows: np.ndarray, fmt_id: int, pages: np.ndarray, ok: np.ndarray,
                removed: bool) -> None:
        at = (self._last[layer, rows] + 1) % len(self._before)  # (the oldest change's place: the new one takes it)
        self._last[layer, rows] = at
        self._before[at, layer, rows] = self._stamp[layer, rows]
        self._stamp_rows(layer, rows)
        self._pages[at, layer, rows] = -1
        if pages.shape[1] > CHANGE_MAX:
            return
        code = np.where(pages >= 0, (pages << _FMT_BITS) | fmt_id, -1)
        self._pages[at, layer, rows, :pages.shape[1]] = np.where(ok[:, None], code, -1)
        self._removed[at, layer, rows] = removed

    def layer_clocks(self) -> np.ndarray:
        """``layer_clock`` of every layer (a copy)."""
        return self._layer_clock.copy()

    def layer_clock(self, layer: int) -> int:
        """Changes whenever a row's page list in ``layer`` changes (the latest stamp handed out there): layers
        whose pages change at different steps (per-layer budgets) keep each other's block tables."""
        return int(self._layer_clock[layer])

    def stamps(self, layer: int, rows: np.ndarray) -> np.ndarray:
        return self._stamp[layer, rows]

    def emptied(self, rows: np.ndarray) -> np.ndarray:
        """Each of ``rows``' stamp (every layer's) when it last held no pages: made, or its request freed. A block
        table that read a row before then may take it as read empty at that stamp, and apply what was recorded
        since (a new request's pages, or a host tier's first moves, need no rewrite from the lists)."""
        return self._emptied[rows]

    def stamps_layers(self, rows: np.ndarray) -> np.ndarray:
        """``stamps`` of every layer: ``[layers, len(rows)]``."""
        return self._stamp[:, rows]

    def since(self, layer: int | np.ndarray, rows: np.ndarray, seen: np.ndarray
              ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]:
        """What changed in ``rows`` (of ``layer``, or of ``layer[i]`` each) since stamps ``seen`` when block tables
        can apply it: ``(covered, changes)``, ``covered`` the rows whose changes since are all recorded, ``changes``
        to apply in order, each ``(rows mask, format ids, pages [n, CHANGE_MAX] -1 padded in order, removed)``,
        oldest first (each for the rows that read before it or before an older one whose changes since are all
        recorded; a change no row applies is left out)."""
        last = self._last[layer, rows]
        code = self._pages[last, layer, rows]
        if (code[:, 0] >= 0).all() and (self._before[last, layer, rows] == seen).all():
            # (a page boundary: every row read right before its last change, which is recorded; stamps only grow,
            # so no older change follows a read; that change alone, without gathering the ring)
            every = np.ones(len(rows), bool)
            return every, [_change(every, code, self._removed[last, layer, rows])]
        return self.since_in_ring(layer, rows, seen)

    def since_in_ring(self, layer: int | np.ndarray, rows: np.ndarray, seen: np.ndarray
                      ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]:
        """``since`` read from every change the ring keeps (its general case)."""
        depth = len(self._before)
        ring = (self._last[layer, rows] + np.arange(1, depth + 1)[:, None]) % depth  # [i]: oldest first
        code = self._pages[ring, layer, rows]
        recorded = code[:, :, 0] >= 0
        since = np.logical_and.accumulate(recorded[::-1], axis=0)[::-1]  # [i]: changes i.. all recorded
        starts = since & (self._before[ring, layer, rows] == seen)  # [i]: the row was read right before change i
        applies = np.logical_or.accumulate(starts, axis=0)  # [i]: change i follows the row's read
        changes = [_change(applies[i], code[i], self._removed[ring[i], layer, rows])
                   for i in range(len(code)) if applies[i].any()]  # (none read before the older ones: skipped)
        return applies[-1], changes


def _change(applies: np.ndarray, code: np.ndarray, removed: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One recorded change of each row as ``since`` lists it, from its codes ``[n, CHANGE_MAX]``: ``(rows mask, format
    ids (-1: not recorded), pages -1 padded, removed)``."""
    return (applies, np.where(code[:, 0] >= 0, code[:, 0] & _FMT_MASK, -1), np.where(code >= 0, code >> _FMT_BITS, -1),
            removed)
