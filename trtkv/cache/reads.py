"""What attention and policies read of a request's pages: dequantized K/V of given positions, block tables
per format, and whether a lone request's tokens form one dense run of pages (a view instead of a gather)."""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from plugins import ops as plugin_ops
from trtkv.cache.block_table import BlockTable
from trtkv.cache.columns import TableColumns
from trtkv.cache.pool import PagePool
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.sequence import SeqKV


def gather_kv_many(pools: PoolSet, columns: TableColumns, layer: int, items: list[tuple[SeqKV, object]],
                   keys_only: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Dequantized fp32 ``k, v [m, H, D]`` of several requests' paged positions in one layer (read-only; for
    selection, not compaction), one dequantization per format for all of them (a batch's anneals read their
    keys in one call instead of one per request). ``keys_only``: gather and dequantize the key fields alone
    (values come back None)."""
    sizes = [len(positions) for _, positions in items]
    out_k, out_v = gather_kv_flat(pools, columns, layer, items, keys_only)
    ks = out_k.split(sizes)
    return list(zip(ks, [None] * len(ks) if keys_only else out_v.split(sizes)))


def gather_kv_flat(pools: PoolSet, columns: TableColumns, layer: int, items: list[tuple[SeqKV, object]],
                   keys_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gather_kv_many``'s keys and values concatenated, ``[sum m, H, D]`` each (no tensor per request)."""
    rows = np.repeat(np.fromiter((seq.row for seq, _ in items), np.int64, len(items)),
                     np.fromiter((len(p) for _, p in items), np.int64, len(items)))
    pos = np.concatenate([np.asarray(p, np.int64).reshape(-1) for _, p in items]) if items else rows
    return gather_kv_rows(pools, columns, layer, rows, pos, keys_only)


def gather_kv_rows(pools: PoolSet, columns: TableColumns, layer: int, rows: np.ndarray, positions: np.ndarray,
                   keys_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gather_kv_flat`` of ``positions[i]`` of table row ``rows[i]``, every i."""
    cfg = pools.cfg
    by_fmt = _slots_by_lookup(pools[layer], columns, layer, rows, positions)
    if len(by_fmt) != 1:  # rows of several formats (or none) land in one output; one format's decode is it
        out_k = torch.empty(len(positions), cfg.num_kv_heads, cfg.head_dim, device=cfg.device)
        out_v = None if keys_only else torch.empty_like(out_k)
    for fmt, (rows, flat) in by_fmt.items():
        pool = pools[layer][fmt]
        flat = torch.from_numpy(flat).to(pool.device)
        scales = pools.layer_scales(layer, fmt)
        if keys_only:  # (a selection's reads: one pass over the asked slots, plugins/gather_keys)
            k, v = plugin_ops.gather_keys(pool.fields, pool.group_fields, pool.k_group, flat, pool.fmt.code,
                                          scales.k), None
        else:
            slot = {f.name: t.flatten(0, 1).index_select(0, flat) for f, t in zip(pool.slot_specs, pool.fields)}
            group = {}
            if pool.group_specs:
                gid = pool.k_group.flatten().index_select(0, flat).long()
                group = {f.name: t.index_select(0, gid) for f, t in zip(pool.group_specs, pool.group_fields)}
            k, v = pool.fmt.decode(slot, group, scales)
        if len(by_fmt) == 1:  # every row, in order
            out_k, out_v = k.float(), None if v is None else v.float()
        else:
            idx = torch.from_numpy(rows).to(pool.device)
            out_k[idx] = k
            if v is not None:
                out_v[idx] = v
    return out_k, out_v


def gather_keys_layers(pools: PoolSet, columns: TableColumns, layers: np.ndarray, rows: np.ndarray,
                       positions: np.ndarray, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The dequantized keys of paged positions in several layers (``positions[i]`` of table row ``rows[i]`` in layer
    ``layers[i]``), one ``[b - a, H, D]`` fp32 tensor for each run ``(a, b)`` of pairs in one layer: one lookup in
    the position maps for every layer, then a kernel call per layer and format (``gather_kv_rows`` of each run)."""
    fids, pages, slots = columns.lookup_layers(layers, rows, positions)
    cfg, out = pools.cfg, []
    for a, b in runs:
        layer = int(layers[a])
        by_fmt = _slots_by_format(pools[layer], columns.fmt_names, fids[a:b], pages[a:b], slots[a:b])
        keys = None if len(by_fmt) == 1 else torch.empty(b - a, cfg.num_kv_heads, cfg.head_dim, device=cfg.device)
        for fmt, (at, flat) in by_fmt.items():
            pool = pools[layer][fmt]
            k = plugin_ops.gather_keys(pool.fields, pool.group_fields, pool.k_group,
                                       torch.from_numpy(flat).to(pool.device), pool.fmt.code,
                                       pools.layer_scales(layer, fmt).k)
            if keys is None:  # every pair of the run, in order
                keys = k.float()
            else:
                keys[torch.from_numpy(at).to(pool.device)] = k
        out.append(keys)
    return out


def locate_many(columns: TableColumns, seqs: list[SeqKV], layer: int, positions: list[np.ndarray]
                ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where ``positions[i]`` of ``seqs[i]`` are paged in ``layer``, concatenated: ``(format names, format ids,
    pages, slots, held)``; ``held`` marks the asked positions held in pages, the others have no entry."""
    lens = [len(p) for p in positions]
    rows = np.repeat(np.fromiter((s.row for s in seqs), np.int64, len(seqs)), lens)
    return locate_flat(columns, layer, rows, np.concatenate(positions) if positions else rows)


def locate_flat(columns: TableColumns, layer: int, rows: np.ndarray, positions: np.ndarray
                ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``locate_many`` of ``positions[i]`` of table row ``rows[i]`` each."""
    held = columns.held_many(layer, rows, positions)
    fids, pages, slots = columns.lookup_many(layer, rows[held], positions[held])
    return columns.fmt_names, fids, pages, slots, held


def _slots_by_lookup(pools: dict[str, PagePool], columns: TableColumns, layer: int, rows: np.ndarray,
                     pos: np.ndarray) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
    """Per format: ``(rows of the output, or None for every row in order; flat slot ids page * B + slot)`` of
    every asked position (``pos[i]`` of table row ``rows[i]``), from the position maps (one array read)."""
    return _slots_by_format(pools, columns.fmt_names, *columns.lookup_many(layer, rows, pos))


def _slots_by_format(pools: dict[str, PagePool], names: tuple[str, ...], fids: np.ndarray, pages: np.ndarray,
                     slots: np.ndarray) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
    """``_slots_by_lookup`` of looked-up ``(format ids, pages, slots)``."""
    present = np.unique(fids).tolist()
    if len(present) == 1:  # every row in one format (the common case)
        fmt = names[present[0]]
        return {fmt: (None, pages * pools[fmt].B + slots)}
    out = {}
    for f in present:
        fmt = names[f]
        sel = np.flatnonzero(fids == f)
        out[fmt] = (sel, pages[sel] * pools[fmt].B + slots[sel])
    return out


def _ints(positions) -> list[int]:
    return positions.tolist() if hasattr(positions, "tolist") else [int(p) for p in positions]


class _RowTables:
    """Every layer's block tables, one row per table row of ``TableColumns`` (any request that was read), per
    format: ``pages [layers, rows, width]`` (-1 padded, spare columns) and ``lens [layers, rows]``; ``seen [layers,
    rows]`` is each row's page-list stamp when it was last brought up to date (-1: never). Layers side by side, so a
    page boundary that changed every layer's rows is applied to all of them in one pass."""

    def __init__(self, num_layers: int) -> None:
        self.pages: dict[str, np.ndarray] = {}
        self.lens: dict[str, np.ndarray] = {}
        self.seen = np.full((num_layers, 0), -1, np.int64)

    def fit(self, rows: int, fmts) -> None:
        """Room for rows ``[0, rows)`` and a table for every format of ``fmts``."""
        L, have = self.seen.shape
        if rows > have:
            grow = max(rows, 2 * have) - have
            self.seen = np.concatenate([self.seen, np.full((L, grow), -1, np.int64)], axis=1)
            for fmt, bt in self.pages.items():
                self.pages[fmt] = np.concatenate([bt, np.full((L, grow, bt.shape[2]), -1, np.int32)], axis=1)
                self.lens[fmt] = np.concatenate([self.lens[fmt], np.zeros((L, grow), np.int64)], axis=1)
        for fmt in fmts:
            if fmt not in self.pages:
                self.pages[fmt] = np.full((*self.seen.shape, FIRST_TABLE_WIDTH), -1, np.int32)
                self.lens[fmt] = np.zeros(self.seen.shape, np.int64)

    def empty_rows(self, layers: np.ndarray, rows: np.ndarray, stamps: np.ndarray) -> None:
        """Rows ``rows`` of ``layers`` (pairs) read as holding no pages at ``stamps``."""
        for fmt, lens in self.lens.items():
            self.pages[fmt][layers, rows, :int(lens[layers, rows].max(initial=0))] = -1
            lens[layers, rows] = 0
        self.seen[layers, rows] = stamps

    def widen(self, fmt: str, width: int) -> np.ndarray:
        """Format ``fmt``'s tables, at least ``width`` columns wide (doubling)."""
        bt = self.pages[fmt]
        if width > bt.shape[2]:
            grown = np.full((*bt.shape[:2], max(width, 2 * bt.shape[2])), -1, np.int32)
            grown[:, :, : bt.shape[2]] = bt
            self.pages[fmt] = bt = grown
        return bt


class BlockTableCache:
    """Each layer's block tables kept per table row: a row is brought up to date only when its page list changed
    since it was last read (page-list stamps, one array comparison for the batch) — taking pages appended at the
    end of a format's list or leaving it in place, rewriting the row from its lists otherwise — and a batch's
    tables are its rows gathered. Reading one layer brings the batch's rows of every layer up to date (a page
    boundary changes them all at once; a layer changed again before it is read is brought up to date again).
    Batches that differ from step to step (requests finishing and joining, groups taking turns) reuse every row
    they share."""

    def __init__(self, num_layers: int) -> None:
        self._tables = _RowTables(num_layers)
        self._last: list[tuple[np.ndarray, int, list] | None] = [None] * num_layers  # rows, clock, what get returned
        self._current: tuple[np.ndarray, np.ndarray] | None = None  # rows all brought up to date, each layer's clock

    def get(self, pools: dict[str, PagePool], layer: int, seqs: list[SeqKV], columns: TableColumns,
            rows: np.ndarray) -> list[tuple[PagePool, torch.Tensor]]:
        """Per format used in ``layer`` (``pools``: that layer's): ``(pool, block_table [b, P] int32, -1 padded)``;
        ``rows``: the requests' rows in ``columns``."""
        if len(seqs) == 1:  # no padding to do; the table caches the tensors until its page lists change
            return seqs[0].layers[layer].single_block_tables(lambda flat: [
                (pools[fmt], torch.from_numpy(pages[None]).to(pools[fmt].device))
                for fmt, pages in flat.items() if len(pages)])  # (a format whose pages were all released has none)
        last = self._last[layer]
        clock = columns.changes.layer_clock(layer)
        if last is not None and last[1] == clock and (last[0] is rows or np.array_equal(last[0], rows)):
            return last[2]  # no page list of this layer changed since, the same requests
        tables = self._tables
        current = self._current
        if current is None or current[0] is not rows or current[1][layer] != clock:
            self._up_to_date(seqs, columns, rows, pools)
        else:
            tables.fit(int(rows.max()) + 1, pools)
        out = []
        for fmt, pool in pools.items():
            width = int(tables.lens[fmt][layer, rows].max(initial=0))
            if width:
                out.append((pool, torch.from_numpy(tables.pages[fmt][layer, rows, :width]).to(pool.device)))
        self._last[layer] = (rows, clock, out)
        return out

    def page_counts(self, seqs: list[SeqKV], columns: TableColumns, rows: np.ndarray, fmts) -> dict[str, np.ndarray]:
        """The pages of each format of ``fmts`` that each of ``rows`` (``seqs``' rows in ``columns``) holds in every
        layer, ``[layers, b]`` (a copy): the rows brought up to date as ``get`` does, their page lists not read where
        their changes since are known."""
        self._up_to_date(seqs, columns, rows, fmts)
        return {fmt: self._tables.lens[fmt][:, rows] for fmt in fmts}

    def layer_rows(self, seqs: list[SeqKV], columns: TableColumns, rows: np.ndarray, layer: int, fmts
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each format's pages of ``rows`` in ``layer`` (``[b, width]``, -1 padded, each row in its table's order)
        and their counts ``[b]`` (copies), the rows brought up to date as ``get`` does."""
        self._up_to_date(seqs, columns, rows, fmts)
        out = {}
        for fmt in fmts:
            lens = self._tables.lens[fmt][layer, rows]
            out[fmt] = (self._tables.pages[fmt][layer, rows, :int(lens.max(initial=0))], lens)  # (indexed: copies)
        return out

    def _up_to_date(self, seqs: list[SeqKV], columns: TableColumns, rows: np.ndarray, fmts) -> None:
        """Every layer's ``rows`` brought up to date (the batch ``get`` then reads: ``rows`` itself)."""
        tables = self._tables
        tables.fit(int(rows.max()) + 1, fmts)
        stamps = columns.changes.stamps_layers(rows)
        at_layer, at = np.nonzero(tables.seen[:, rows] != stamps)
        if len(at):
            emptied = columns.changes.emptied(rows[at])
            before = tables.seen[at_layer, rows[at]] < emptied  # (never read, or read before its request was freed)
            if before.any():  # read as empty when last emptied: what was recorded since applies in place
                tables.empty_rows(at_layer[before], rows[at[before]], emptied[before])
                still = tables.seen[at_layer, rows[at]] != stamps[at_layer, at]  # (unchanged since: done)
                at_layer, at = at_layer[still], at[still]
        if len(at):
            self._bring_up_to_date(tables, at_layer, seqs, at, columns, rows[at])
            tables.seen[at_layer, rows[at]] = stamps[at_layer, at]
        # every layer's rows now up to date: a layer whose clock has not moved since needs no look
        self._current = (rows, columns.changes.layer_clocks())

    @staticmethod
    def _bring_up_to_date(tables: _RowTables, layers: np.ndarray, seqs: list[SeqKV], stale: np.ndarray,
                          columns: TableColumns, rows: np.ndarray) -> None:
        """Rows ``rows`` of ``layers`` (of ``seqs[stale]``; (layer, row) pairs) whose page lists changed since they
        were last read: the ones whose changes since that read were pages joining the end of a format's list or
        leaving it (``PageChanges``) apply them in place (array operations: a page boundary or an eviction event of
        the whole batch touches no request object); the others are rewritten from their lists."""
        covered, changes = columns.changes.since(layers, rows, tables.seen[layers, rows])
        names = columns.fmt_names
        for applies, fids, pages, removed in changes:
            for f in np.unique(fids[applies]).tolist():
                tables.fit(0, (names[f],))
                mine = applies & (fids == f)
                add, gone = mine & ~removed, mine & removed
                _append_in_place(tables, names[f], layers[add], rows[add], pages[add])
                _remove_in_place(tables, names[f], layers[gone], rows[gone], pages[gone])
        rest = np.flatnonzero(~covered)
        for layer in np.unique(layers[rest]).tolist():  # (rewritten from the tables' lists, a layer at a time)
            mine = rest[layers[rest] == layer]
            tabs = [seqs[i].layers[layer] for i in stale[mine].tolist()]
            BlockTable.catch_up_each(tabs)
            at = rows[mine]
            tables.fit(0, {fmt for t in tabs for fmt, _ in t.pages})
            for fmt, lens in tables.lens.items():
                lists = [t.page_lists_of(fmt) for t in tabs]
                new = np.fromiter((sum(map(len, ls)) for ls in lists), np.int64, len(lists))
                bt = tables.widen(fmt, int(new.max(initial=0)))
                bt[layer, at, : int(lens[layer, at].max(initial=0))] = -1
                lens[layer, at] = new
                _fill_rows(bt[layer], at, lists, new)


FIRST_TABLE_WIDTH = 16  # pages a row of a layer's block tables holds before its format's table widens


def _append_in_place(tables: _RowTables, fmt: str, layers: np.ndarray, at: np.ndarray, new: np.ndarray) -> None:
    """Rows ``at`` (of ``layers``) of ``fmt``'s block tables take pages ``new [n, k]`` (-1 padded) at their ends."""
    if not len(at):
        return
    count = (new >= 0).sum(axis=1)
    lens = tables.lens[fmt]
    bt = tables.widen(fmt, int((lens[layers, at] + count).max()))
    for j in range(int(count.max())):
        has = count > j
        bt[layers[has], at[has], lens[layers[has], at[has]] + j] = new[has, j]
    lens[layers, at] += count


def _remove_in_place(tables: _RowTables, fmt: str, layers: np.ndarray, at: np.ndarray, gone: np.ndarray) -> None:
    """Rows ``at`` (of ``layers``) of ``fmt``'s block tables drop pages ``gone [n, k]`` (-1 padded); the others keep
    their order."""
    if not len(at):
        return
    lens, bt = tables.lens[fmt], tables.pages[fmt]
    width = int(lens[layers, at].max(initial=0))
    cur = bt[layers, at, :width]
    inside = np.arange(width) < lens[layers, at][:, None]
    kept = inside & ~(cur[:, :, None] == np.where(gone >= 0, gone, -2)[:, None, :]).any(axis=2)
    order = np.argsort(~kept, axis=1, kind="stable")  # each row's kept pages first, in order
    bt[layers[:, None], at[:, None], np.arange(width)] = np.where(
        np.arange(width) < kept.sum(axis=1)[:, None], np.take_along_axis(cur, order, 1), -1)
    lens[layers, at] = kept.sum(axis=1)


def _fill_rows(bt: np.ndarray, at: np.ndarray, rows: list[list[list[int]]], lens: np.ndarray) -> None:
    """``bt[at[i], :lens[i]] =`` the lists ``rows[i]`` joined, for every i, in one scatter."""
    total = int(lens.sum())
    if not total:
        return
    starts = np.cumsum(lens) - lens
    cols = np.arange(total) - np.repeat(starts, lens)
    bt[np.repeat(at, lens), cols] = np.fromiter(chain.from_iterable(chain.from_iterable(rows)), np.int32, total)
