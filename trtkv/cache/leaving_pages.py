"""``LeavingPages``: pages an eviction emptied and released that are still in their tables' Python page lists.

An event that empties pages in every table of a batch (LazyEviction's and ThinKV's, at 32 layers × 256 requests:
8,192 tables) would otherwise take each page out of its table's list in Python, table by table. Here the event
records the pages, their format and class per (layer, row) as array writes, and a table drops its row's entries
from its lists the first time it reads them (``BlockTable._catch_up``) — before it takes the pages waiting to join
(``FreshPages``): a page that left may have come back as a fresh page of the same table, and that one stays. The
batch's block tables drop the pages in place meanwhile (``PageChanges.remove_rows``), so a decode step reads no
table's lists and the entries wait.
"""
from __future__ import annotations

import numpy as np

from trtkv.cache.fresh_pages import PageQueues

DEPTH = 16  # pages a row may have waiting to leave; a table whose row cannot take more drops its own at once


class LeavingPages(PageQueues):
    """Per layer and table row, the pages released from the row's lists that are still in them."""

    def __init__(self, num_layers: int, rows: int) -> None:
        super().__init__(num_layers, rows, DEPTH)

    def fits(self, layer: int, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Whether each job (row ``rows[j]`` leaving ``counts[j]`` pages; a row may repeat) fits its row's room, with
        every job of the row counted."""
        if not len(rows):
            return np.zeros(0, bool)
        total = np.bincount(rows, weights=counts).astype(np.int64)  # (by row number: no sort of the rows)
        return self._n[layer, rows] + total[rows] <= self._page.shape[2]

    def add(self, layer: int, rows: np.ndarray, fmt_id: int, classes: np.ndarray, pages: np.ndarray) -> None:
        """Page ``pages[i]`` (format ``fmt_id``, class ``classes[i]``) leaves row ``rows[i]``'s lists in ``layer`` (rows
        may repeat; ``fits`` said they have room)."""
        if not len(pages):
            return
        order = np.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        u, first, counts = np.unique(sorted_rows, return_index=True, return_counts=True)
        at = np.empty(len(rows), np.int64)
        at[order] = self._n[layer, sorted_rows] + np.arange(len(rows)) - np.repeat(first, counts)
        self._page[layer, rows, at] = pages
        self._fmt[layer, rows, at] = fmt_id
        self._cls[layer, rows, at] = classes
        self._n[layer, u] += counts
