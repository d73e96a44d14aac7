"""``CacheReads``: what ``KVCacheManager`` holds, read — positions, keys and values, block tables, counts and
bytes. Nothing here changes the cache; the manager's own verbs (writes, evictions, flushes) do."""
from __future__ import annotations

import numpy as np
import torch

from trtkv.cache import reads
from trtkv.cache.block_table import ENTRY_BYTES, held_page_bytes
from trtkv.cache.columns import TableColumns
from trtkv.cache.config import CacheConfig
from trtkv.cache.forks import PageRefs
from trtkv.cache.index_ops import split_counts
from trtkv.cache.pool import PagePool
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.residual import ResidualArena
from trtkv.cache.sequence import SeqKV


class CacheReads:
    """The read verbs of ``KVCacheManager`` (its base: the state they read is the manager's)."""

    cfg: CacheConfig
    pools: PoolSet
    columns: TableColumns
    refs: PageRefs
    residual: ResidualArena | None
    seqs: dict[int, SeqKV]
    _batch_tables: reads.BlockTableCache

    _rows_of: tuple[list | None, np.ndarray]  # the last batch asked about, and its rows
    _residual_rows_of: tuple[list | None, np.ndarray]
    _residual_distinct: bool

    # --- rows ------------------------------------------------------------------------------
    def rows(self, seqs: list[SeqKV]) -> np.ndarray:
        """The requests' rows in ``columns``, as an array (remembered for the same list, which the caller does
        not change: a decode step asks once per layer; the same rows in the same order give the same array object,
        step after step, and nobody writes into it)."""
        last, rows = self._rows_of
        if last is not seqs or len(rows) != len(seqs):
            new = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
            if not np.array_equal(new, rows):  # the same rows keep the same array: later checks are identity tests
                rows = new
            self._rows_of = (seqs, rows)
        return rows

    def residual_rows(self, seqs: list[SeqKV]) -> np.ndarray:
        """The requests' residual-arena rows, remembered for the same list like ``rows``."""
        last, rows = self._residual_rows_of
        if last is not seqs or len(rows) != len(seqs):
            rows = np.fromiter((s.residual.row for s in seqs), np.int64, len(seqs))
            self._residual_rows_of = (seqs, rows)
            self._residual_distinct = len(rows) < 2 or len(np.unique(rows)) == len(rows)  # (a prompt's tail repeats)
        return rows

    def buffered_many(self, seqs: list[SeqKV], layer: int) -> np.ndarray:
        """Tokens each of ``seqs`` holds in its residual buffer in ``layer`` (zeros without buffers)."""
        if self.residual is None:
            return np.zeros(len(seqs), np.int64)
        return self.residual.fill[self.residual_rows(seqs), layer]

    def buffered_any(self, layer: int, seqs: list[SeqKV], positions: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Per request ``i``: whether any of its ``counts[i]`` of ``positions`` is in its ``layer`` residual buffer."""
        if self.residual is None:
            return np.zeros(len(seqs), bool)
        return self.residual.holds_any(layer, self.residual_rows(seqs), positions, counts)

    # --- reads ------------------------------------------------------------------------------
    def live_positions(self, seq: SeqKV, layer: int) -> np.ndarray:
        """Positions held in pages (not the residual buffer), ascending."""
        return seq.layers[layer].positions()

    def live_positions_rows(self, seqs: list[SeqKV], layer: int, n: int) -> np.ndarray:
        """``[len(seqs), n]`` paged positions, ascending, of ``seqs`` that each hold exactly ``n`` in pages."""
        return self.columns.positions_rows(layer, np.fromiter((s.row for s in seqs), np.int64, len(seqs)), n)

    def live_positions_rows_layers(self, seqs: list[SeqKV], n: int) -> np.ndarray:
        """``live_positions_rows`` of every layer, ``[L, len(seqs), n]`` (each holds ``n`` in every layer)."""
        return self.columns.positions_rows_all(self.rows(seqs), n)

    def num_paged_many(self, seqs: list[SeqKV], layer: int) -> np.ndarray:
        """Tokens each of ``seqs`` holds in pages in ``layer`` (one array read for the batch)."""
        return self.columns.live_rows(layer, self.rows(seqs))

    def live_positions_in(self, seq: SeqKV, layer: int, lo: int, hi: int) -> np.ndarray:
        """Paged positions in ``[lo, hi)``, ascending."""
        return self.columns.positions_in(layer, seq.row, int(lo), int(hi))

    def live_positions_in_many(self, seqs: list[SeqKV], layer: int, lo: np.ndarray, hi: np.ndarray) -> list[np.ndarray]:
        """``live_positions_in`` of each ``(seqs[i], lo[i], hi[i])`` (a request may appear more than once)."""
        return split_counts(*self.live_positions_in_flat(seqs, layer, lo, hi))

    def live_positions_in_flat(self, seqs: list[SeqKV], layer: int, lo: np.ndarray, hi: np.ndarray
                               ) -> tuple[np.ndarray, np.ndarray]:
        """``live_positions_in_many`` concatenated: ``(positions, counts)``."""
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        return self.columns.positions_in_flat(layer, rows, np.asarray(lo, np.int64), np.asarray(hi, np.int64))

    def live_positions_in_flat_layers(self, seqs: list[SeqKV], lo: np.ndarray, hi: np.ndarray
                                      ) -> tuple[np.ndarray, np.ndarray]:
        """``live_positions_in_flat`` of every layer: ``(positions, counts [layers, len(seqs)])``, layer after
        layer."""
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        return self.columns.positions_in_flat_layers(rows, np.asarray(lo, np.int64), np.asarray(hi, np.int64))

    def oldest_buffered_many(self, seqs: list[SeqKV], layers: np.ndarray | None = None,
                             which: np.ndarray | None = None) -> np.ndarray:
        """The oldest position each of ``seqs`` (or of ``seqs[which[j]]`` each) holds in a residual buffer of any
        layer, or of its one of ``layers`` (int64 max where none)."""
        n = len(seqs) if which is None else len(which)
        if self.residual is None:
            return np.full(n, np.iinfo(np.int64).max)
        rows = self.residual_rows(seqs)
        return self.residual.oldest_rows(rows if which is None else rows[which], layers)

    def locate_many(self, seqs: list[SeqKV], layer: int, positions: list[np.ndarray]
                    ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where ``positions[i]`` of ``seqs[i]`` are paged in ``layer`` (``reads.locate_many``)."""
        return reads.locate_many(self.columns, seqs, layer, positions)

    def locate_flat(self, layer: int, rows: np.ndarray, positions: np.ndarray
                    ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``locate_many`` with every position's table row given (``rows[i]`` of ``positions[i]``: ``rows`` repeated
        by job)."""
        return reads.locate_flat(self.columns, layer, rows, positions)

    def held_flat(self, layer: int, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Whether ``positions[i]`` of table row ``rows[i]`` is paged in ``layer``, each."""
        return self.columns.held_many(layer, rows, positions)

    def gather_kv(self, seq: SeqKV, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized fp32 ``k, v [m, H, D]`` of paged tokens (``trtkv/cache/reads.py``)."""
        return reads.gather_kv_many(self.pools, self.columns, layer, [(seq, positions)])[0]

    def gather_kv_many(self, layer: int, items: list[tuple[SeqKV, object]], keys_only: bool = False
                       ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``gather_kv`` of several requests in one read per format (``trtkv/cache/reads.py``)."""
        return reads.gather_kv_many(self.pools, self.columns, layer, items, keys_only)

    def gather_kv_flat(self, layer: int, seqs: list[SeqKV], positions: np.ndarray, counts: np.ndarray,
                       keys_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dequantized keys and values of paged positions, ``counts[i]`` of ``positions`` of ``seqs[i]``,
        concatenated ``[sum counts, H, D]`` each (values None with ``keys_only``)."""
        rows = np.repeat(np.fromiter((s.row for s in seqs), np.int64, len(seqs)), counts)
        return reads.gather_kv_rows(self.pools, self.columns, layer, rows, positions, keys_only)

    def gather_keys_flat(self, layer: int, seqs: list[SeqKV], positions: np.ndarray, counts: np.ndarray
                         ) -> torch.Tensor:
        """``gather_kv_flat``'s keys alone."""
        return self.gather_kv_flat(layer, seqs, positions, counts, keys_only=True)[0]

    def gather_keys_layers(self, layers: np.ndarray, seqs: list[SeqKV], positions: np.ndarray, counts: np.ndarray,
                           runs: list[tuple[int, int]], which: np.ndarray | None = None) -> list[torch.Tensor]:
        """``gather_keys_flat`` of jobs in several layers (job ``i``: ``counts[i]`` of ``positions``, of ``seqs[i]``, or
        of ``seqs[which[i]]``, in layer ``layers[i]``): one tensor for each run ``(a, b)`` of jobs in one layer."""
        rows = self.rows(seqs)
        rows = np.repeat(rows if which is None else rows[which], counts)
        ends = np.r_[0, np.cumsum(counts)]
        return reads.gather_keys_layers(self.pools, self.columns, np.repeat(layers, counts), rows, positions,
                                        [(int(ends[a]), int(ends[b])) for a, b in runs])

    def block_tables(self, layer: int, seqs: list[SeqKV]) -> list[tuple[PagePool, torch.Tensor]]:
        """Per format used in this layer: ``(pool, block_table [b, P] int32, -1 padded)``."""
        return self._batch_tables.get(self.pools[layer], layer, seqs, self.columns, self.rows(seqs))

    def page_bytes_layers(self, seqs: list[SeqKV]) -> np.ndarray:
        """``[layers, b]``: the bytes of the pages each of ``seqs`` holds in every layer (the pages alone), counted
        from the batch's block tables (``BlockTableCache.page_counts``), not from the tables' page lists."""
        L = len(self.pools)
        fmts = list(dict.fromkeys(fmt for layer in range(L) for fmt in self.pools[layer]))
        counts = self._batch_tables.page_counts(seqs, self.columns, self.rows(seqs), fmts)
        out = np.zeros((L, len(seqs)), np.int64)
        for fmt, n in counts.items():
            size = np.fromiter((self.pools[layer][fmt].page_bytes if fmt in self.pools[layer] else 0
                                for layer in range(L)), np.int64, L)
            out += n * size[:, None]
        return out

    def table_positions_layers(self, tables: list[tuple[PagePool, torch.Tensor]]
                               ) -> tuple[np.ndarray, np.ndarray] | None:
        """The positions behind every layer's block table (``tables[layer]``, as ``block_tables`` gave it) in one
        read: ``[layers, b, n]`` and held counts ``[layers, b]``; None unless they are every layer's, of one
        stacked format and one shape."""
        fmts = {pool.fmt.name for pool, _ in tables}
        stack = self.pools.stack(next(iter(fmts))) if len(fmts) == 1 else None
        if stack is None or len(tables) != self.cfg.num_layers or len({bt.shape for _, bt in tables}) != 1 or \
                any(pool is not self.pools[layer].get(pool.fmt.name) for layer, (pool, _) in enumerate(tables)):
            return None
        return stack.table_positions([bt for _, bt in tables])

    def dense_run(self, layer: int, seqs: list[SeqKV]) -> tuple[int, int] | None:
        """``(first page, live tokens)`` when a lone request's tokens are one dense run of pages."""
        return seqs[0].layers[layer].dense_run() if len(seqs) == 1 else None

    # --- bytes ------------------------------------------------------------------------------
    def seq_bytes(self, seq: SeqKV) -> int:
        """Bytes the cache holds for this request: its pages (codes, scales, page metadata, block-table
        entries), the key-scale groups its live tokens point at, and its residual buffer."""
        return seq.kv_bytes

    def recount_bytes(self, seq: SeqKV) -> int:
        """The same total recomputed from the pools (the running counter's test oracle)."""
        total = 0 if seq.residual is None else seq.residual.nbytes
        for layer, table in enumerate(seq.layers):
            groups: set[tuple[str, int]] = set()
            for (fmt, _), pages in table.pages.items():
                total += len(pages) * held_page_bytes(self.pools[layer][fmt])
            for fmt, p, s in table.loc.values():
                pool = self.pools[layer][fmt]
                if pool.group_specs:
                    groups.add((fmt, int(pool.k_group[p, s])))
            total += sum(self.pools[layer][f].group_bytes for f, _ in groups)
        return total

    def num_live_many(self, seqs: list[SeqKV], layer: int) -> np.ndarray:
        """Tokens each of ``seqs`` holds in ``layer``, paged and buffered (one array read for the batch)."""
        n = self.num_paged_many(seqs, layer)
        return n + self.buffered_many(seqs, layer) if self.residual is not None else n

    def num_paged_layers(self, seqs: list[SeqKV]) -> np.ndarray:
        """``num_paged_many`` of every layer at once: ``[L, len(seqs)]``."""
        return self.columns.live_rows_layers(self.rows(seqs))

    def num_live_layers(self, seqs: list[SeqKV]) -> np.ndarray:
        """``num_live_many`` of every layer at once: ``[L, len(seqs)]``."""
        n = self.columns.live_rows_layers(self.rows(seqs))
        return n + self.residual.fill[self.residual_rows(seqs)].T if self.residual is not None else n

    def live_tokens(self, seq: SeqKV) -> list[int]:
        return [t.live for t in seq.layers]

    def shared_bytes(self, seq: SeqKV) -> int:
        """Bytes of the pages ``seq`` references that another live sequence references too."""
        return self.refs.shared_bytes(self.pools, seq)

    def live_slots(self, layer: int = 0) -> int:
        """Tokens one layer holds in pages across the engine, each physical slot once."""
        return int(sum(int(np.sum(pool.live)) for pool in self.pools[layer].values()))

    def engine_bytes(self) -> int:
        """Bytes the cache holds across all requests, each physical page and key-scale group once (forked
        sequences share pages), plus every request's block-table entries and residual buffer."""
        total = 0
        for pool in self.pools.all_pools():
            total += pool.in_use * pool.page_bytes + pool.groups_in_use * pool.group_bytes
        for seq in self.seqs.values():
            total += ENTRY_BYTES * sum(t.num_pages() for t in seq.layers)
            if seq.residual is not None:
                total += seq.residual.nbytes
        return total

    def pages_in_use(self) -> int:
        return self.pools.pages_in_use()

    def pool_bytes(self) -> int:
        """Bytes the pools reserved (allocated once, used or not)."""
        return self.pools.reserved_bytes()

    def pool_peak_bytes(self) -> int:
        """Bytes of the most pages and groups each pool had in use at once (what the runs needed)."""
        return self.pools.peak_bytes()
