"""``FreshPages``: pages a batch's page boundary gave to block tables, not yet in their Python page lists.

Every request of a lockstep batch fills its open page on the same step, so at 32 layers × 256 requests a page
boundary hands out 8,192 pages; appending each to its table's lists (and numbering it) is Python work per
(request, layer). Here a boundary records the pages, their format and their order numbers per (layer, row) as
array writes, and a table moves its row's entries into its lists the first time it reads them
(``BlockTable``: page lists, order numbers, flat page arrays). The batch's block tables take the pages in place
meanwhile (``TableColumns.append_rows``), so a decode step reads no table's lists and the entries wait.

Only pages of thought class 0 wait here, and only while no table of the cache has held another class: then
every format's pages are one list per table and a fresh page always ends its format's list.
"""
from __future__ import annotations

import numpy as np

DEPTH = 16  # pages a row may have waiting; a table whose row is full takes them in first (every 16th boundary)


class FreshPages:
    """Per layer and table row, the pages waiting to join the row's lists, in the order they were given."""

    def __init__(self, num_layers: int, rows: int) -> None:
        self._n = np.zeros((num_layers, rows), np.int64)
        self._page = np.zeros((num_layers, rows, DEPTH), np.int32)
        self._order = np.zeros((num_layers, rows, DEPTH), np.int64)
        self._fmt = np.zeros((num_layers, rows, DEPTH), np.int8)
        self.thoughts = False  # a table has held a page of a thought class other than 0: nothing waits any more

    def add(self, layer: int, rows: np.ndarray, fmt_id: int, pages: np.ndarray, orders: np.ndarray) -> None:
        """Page ``pages[i]`` (format ``fmt_id``, order number ``orders[i]``) joins row ``rows[i]`` (distinct, none
        of them ``full``)."""
        n = self._n[layer, rows]
        self._page[layer, rows, n] = pages
        self._order[layer, rows, n] = orders
        self._fmt[layer, rows, n] = fmt_id
        self._n[layer, rows] = n + 1

    def full(self, layer: int, rows: np.ndarray, more: int = 1) -> np.ndarray:
        """Which of ``rows`` cannot take ``more`` waiting pages in ``layer``."""
        return self._n[layer, rows] + more > DEPTH

    def waiting(self, layer: int, row: int) -> bool:
        return self._n.item(layer, row) > 0

    def take(self, layer: int, row: int) -> tuple[list[int], list[int], list[int]]:
        """Format ids, pages and order numbers of the pages waiting for ``row`` in ``layer``, oldest first; they
        wait no more."""
        n = self._n.item(layer, row)
        self._n[layer, row] = 0
        return (self._fmt[layer, row, :n].tolist(), self._page[layer, row, :n].tolist(),
                self._order[layer, row, :n].tolist())

    def clear_row(self, row: int) -> None:
        self._n[:, row] = 0

    def grow_rows(self, rows: int) -> None:
        extra = rows - self._n.shape[1]
        self._n = np.concatenate([self._n, np.zeros((self._n.shape[0], extra), np.int64)], axis=1)
        self._page, self._order, self._fmt = (
            np.concatenate([a, np.zeros((a.shape[0], extra, a.shape[2]), a.dtype)], axis=1)
            for a in (self._page, self._order, self._fmt))
