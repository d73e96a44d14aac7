"""``FreshPages``: pages a batch's page boundary or flush gave to block tables, not yet in their Python page lists.

Every request of a lockstep batch fills its open page (or its residual buffer) on the same step, so at 32 layers
× 256 requests a page boundary hands out 8,192 pages; appending each to its table's lists is Python work per
(request, layer). Here a boundary records the pages, their format and class per (layer, row) as array writes
(their order numbers go to ``ReusableSlots``, which keeps every page's), and a table moves its row's entries
into its lists the first time it reads them (``BlockTable``: page lists, flat page arrays). The batch's block
tables take the pages in place meanwhile (``PageChanges.append_rows``), so a decode step reads no table's lists
and the entries wait.

A format's block table is its class lists joined in the order the table first listed each class, so a page
ends its format's pages only when its class is the format's last listed one: ``list_classes`` keeps that
order per (layer, row) — the tables report each class they list (``list_class``), and a batch that gives pages
of a class lists it for every row at once — and says where the given pages end their format's pages.
"""
from __future__ import annotations

import numpy as np

DEPTH = 16  # pages a row may have waiting; a table whose row is full takes them in first (every 16th boundary)


class PageQueues:
    """Per layer and table row, up to ``depth`` pages with their format and class, in the order they came: what a
    table's Python lists still owe it (``FreshPages``: pages to join them; ``LeavingPages``: pages to leave them)."""

    def __init__(self, num_layers: int, rows: int, depth: int) -> None:
        self._n = np.zeros((num_layers, rows), np.int64)
        self._page = np.zeros((num_layers, rows, depth), np.int32)
        self._fmt = np.zeros((num_layers, rows, depth), np.int8)
        self._cls = np.zeros((num_layers, rows, depth), np.int16)

    def waiting(self, layer: int, row: int) -> bool:
        return self._n.item(layer, row) > 0

    def waiting_rows(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` have pages waiting in ``layer``."""
        return self._n[layer, rows] > 0

    def take(self, layer: int, row: int) -> tuple[list[int], list[int], list[int]]:
        """Format ids, classes and pages waiting for ``row`` in ``layer``, oldest first; they wait no more."""
        n = self._n.item(layer, row)
        self._n[layer, row] = 0
        return (self._fmt[layer, row, :n].tolist(), self._cls[layer, row, :n].tolist(),
                self._page[layer, row, :n].tolist())

    def clear_row(self, row: int) -> None:
        self._n[:, row] = 0

    def grow_rows(self, rows: int) -> None:
        extra = rows - self._n.shape[1]
        self._n = np.concatenate([self._n, np.zeros((self._n.shape[0], extra), np.int64)], axis=1)
        self._page, self._fmt, self._cls = (
            np.concatenate([a, np.zeros((a.shape[0], extra, a.shape[2]), a.dtype)], axis=1)
            for a in (self._page, self._fmt, self._cls))


class FreshPages(PageQueues):
    """Per layer and table row, the pages waiting to join the row's lists, in the order they were given (-1: a page
    released while waiting, ``drop``), and the classes each row's table lists per format."""

    def __init__(self, num_layers: int, rows: int) -> None:
        super().__init__(num_layers, rows, DEPTH)
        self._listed: dict[tuple[int, int], np.ndarray] = {}  # (format id, class) -> [layers, rows] listed
        self._last: dict[int, np.ndarray] = {}  # format id -> [layers, rows] its class listed last, -1 none

    def add(self, layer: int | np.ndarray, rows: np.ndarray, fmt_id: int, pages: np.ndarray, cls: int = 0) -> None:
        """Page ``pages[i]`` (format ``fmt_id``, class ``cls``) joins row ``rows[i]`` of ``layer`` (or of ``layer[i]``;
        (layer, row) pairs distinct, none of them ``full``)."""
        n = self._n[layer, rows]
        self._page[layer, rows, n] = pages
        self._fmt[layer, rows, n] = fmt_id
        self._cls[layer, rows, n] = cls
        self._n[layer, rows] = n + 1

    def full(self, layer: int, rows: np.ndarray, more: int = 1) -> np.ndarray:
        """Which of ``rows`` cannot take ``more`` waiting pages in ``layer``."""
        return self._n[layer, rows] + more > DEPTH

    def drop(self, layer: int, rows: np.ndarray, fmt_id: int, pages: np.ndarray) -> np.ndarray:
        """Pages ``pages[i]`` (format ``fmt_id``) leave row ``rows[i]``'s waiting pages in ``layer``, where they wait
        (released before their table read them); returns which of them were waiting. Their entries stay, emptied
        (-1), so the row's table still lists their classes, in the same order, when it takes its pages in."""
        n = self._n[layer, rows]
        w = int(n.max(initial=0))
        if not w:
            return np.zeros(len(pages), bool)
        hit = ((self._page[layer, rows, :w] == pages[:, None]) & (np.arange(w) < n[:, None])
               & (self._fmt[layer, rows, :w] == fmt_id))
        found = hit.any(1)
        at = np.flatnonzero(found)
        self._page[layer, rows[at], hit[at].argmax(1)] = -1
        return found

    def take_rows(self, layer: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``take`` of each of ``rows`` (distinct), read in one pass: ``(counts [n], format ids, classes, pages
        [n, width])``, row ``i``'s first ``counts[i]`` entries its pages, oldest first."""
        n = self._n[layer, rows]
        self._n[layer, rows] = 0
        w = int(n.max(initial=0))
        return n, self._fmt[layer, rows, :w], self._cls[layer, rows, :w], self._page[layer, rows, :w]

    # --- the classes each table lists, in order ------------------------------------------------------------
    def _columns(self, fmt_id: int, cls: int) -> tuple[np.ndarray, np.ndarray]:
        listed = self._listed.get((fmt_id, cls))
        if listed is None:
            listed = self._listed[(fmt_id, cls)] = np.zeros(self._n.shape, bool)
        last = self._last.get(fmt_id)
        if last is None:
            last = self._last[fmt_id] = np.full(self._n.shape, -1, np.int16)
        return listed, last

    def list_class(self, layer: int, row: int, fmt_id: int, cls: int) -> None:
        """Row ``row``'s table in ``layer`` lists class ``cls`` of format ``fmt_id`` (after any it listed before)."""
        listed, last = self._columns(fmt_id, cls)
        if not listed.item(layer, row):
            listed[layer, row] = True
            last[layer, row] = cls

    def list_classes(self, layer: int | np.ndarray, rows: np.ndarray, fmt_id: int, cls: int) -> np.ndarray:
        """``list_class`` for every one of ``rows`` (of ``layer``, or of ``layer[i]``); returns whether pages of the
        class joining each row end its format's pages (the class is, or becomes, the format's last listed)."""
        listed, last = self._columns(fmt_id, cls)
        known = listed[layer, rows]
        at_end = ~known | (last[layer, rows] == cls)
        new_layer, new = (layer if np.ndim(layer) == 0 else layer[~known]), rows[~known]
        listed[new_layer, new] = True
        last[new_layer, new] = cls
        return at_end

    # --- rows ---------------------------------------------------------------------------------------------
    def clear_row(self, row: int) -> None:
        super().clear_row(row)
        for listed in self._listed.values():
            listed[:, row] = False
        for last in self._last.values():
            last[:, row] = -1

    def grow_rows(self, rows: int) -> None:
        extra = rows - self._n.shape[1]
        super().grow_rows(rows)
        for key, listed in self._listed.items():
            self._listed[key] = np.concatenate([listed, np.zeros((listed.shape[0], extra), bool)], axis=1)
        for key, last in self._last.items():
            self._last[key] = np.concatenate([last, np.full((last.shape[0], extra), -1, np.int16)], axis=1)


def group_waiting(n: np.ndarray, fids: np.ndarray, classes: np.ndarray, pages: np.ndarray
                  ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Waiting entries of several tables (``FreshPages.take_rows``: table ``i``'s first ``n[i]`` entries) grouped by
    (table, format, class), groups in the order of their first entry and each group's pages in order: ``(bounds,
    table, format id, class, pages)``, group ``g`` being ``pages[bounds[g]:bounds[g + 1]]`` (-1: dropped)."""
    j, col = np.nonzero(np.arange(fids.shape[1]) < n[:, None])  # (row-major: a table's pages in order)
    cl = classes[j, col].astype(np.int64) - int(classes.min())
    code = (j * (int(fids.max()) + 1) + fids[j, col]) * (int(cl.max()) + 1) + cl
    _, first, group = np.unique(code, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")  # groups in order of their first page
    rank = np.empty(len(first), np.int64)
    rank[by_first] = np.arange(len(first))
    order = np.argsort(rank[group.reshape(-1)], kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(group.reshape(-1), minlength=len(first))[by_first])].tolist()
    heads = order[bounds[:-1]]
    return (bounds, j[heads].tolist(), fids[j[heads], col[heads]].tolist(), classes[j[heads], col[heads]].tolist(),
            pages[j, col][order].tolist())
