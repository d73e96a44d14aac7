"""What attention and policies read of a request's pages: dequantized K/V of given positions, block tables
per format, and whether a lone request's tokens form one dense run of pages (a view instead of a gather)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

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
    cfg = pools.cfg
    sizes = [len(positions) for _, positions in items]
    by_fmt = _slots_by_lookup(pools[layer], columns, layer, items)
    if len(by_fmt) != 1:  # rows of several formats (or none) land in one output; one format's decode is it
        out_k = torch.empty(sum(sizes), cfg.num_kv_heads, cfg.head_dim, device=cfg.device)
        out_v = None if keys_only else torch.empty_like(out_k)
    for fmt, (rows, flat) in by_fmt.items():
        pool = pools[layer][fmt]
        flat = torch.from_numpy(flat).to(pool.device)
        slot = {f.name: t.flatten(0, 1).index_select(0, flat) for f, t in zip(pool.slot_specs, pool.fields)
                if not keys_only or f.name == "k"}
        group = {}
        if pool.group_specs:
            gid = pool.k_group.flatten().index_select(0, flat).long()
            group = {f.name: t.index_select(0, gid) for f, t in zip(pool.group_specs, pool.group_fields)}
        scales = pools.layer_scales(layer, fmt)
        k, v = (pool.fmt.decode_keys(slot, group, scales), None) if keys_only else pool.fmt.decode(slot, group,
                                                                                                     scales)
        if len(by_fmt) == 1:  # every row, in order
            out_k, out_v = k.float(), None if v is None else v.float()
        else:
            idx = torch.from_numpy(rows).to(pool.device)
            out_k[idx] = k
            if v is not None:
                out_v[idx] = v
    ks = out_k.split(sizes)
    return list(zip(ks, [None] * len(ks) if keys_only else out_v.split(sizes)))


def locate_many(columns: TableColumns, seqs: list[SeqKV], layer: int, positions: list[np.ndarray]
                ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where ``positions[i]`` of ``seqs[i]`` are paged in ``layer``, concatenated: ``(format names, format ids,
    pages, slots, held)``; ``held`` marks the asked positions held in pages, the others have no entry."""
    lens = [len(p) for p in positions]
    rows = np.repeat(np.fromiter((s.row for s in seqs), np.int64, len(seqs)), lens)
    pos = np.concatenate(positions) if positions else rows
    held = columns.held_many(layer, rows, pos)
    fids, pages, slots = columns.lookup_many(layer, rows[held], pos[held])
    return columns.fmt_names, fids, pages, slots, held


def _slots_by_lookup(pools: dict[str, PagePool], columns: TableColumns, layer: int, items
                     ) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
    """Per format: ``(rows of the output, or None for every row in order; flat slot ids page * B + slot)`` of
    every asked position, from the requests' position maps (one array read for the batch)."""
    rows = np.concatenate([np.full(len(p), seq.row, np.int64) for seq, p in items]) if items else \
        np.empty(0, np.int64)
    pos = np.concatenate([np.asarray(p, np.int64).reshape(-1) for _, p in items]) if items else rows
    fids, pages, slots = columns.lookup_many(layer, rows, pos)
    names = columns.fmt_names
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


NO_PAGES = np.empty(0, np.int32)  # a sequence without pages of a format
REWRITE_SHARE = 8  # a batch's cached block tables are patched row by row when at most 1/8 of its rows changed


class _LayerTables(NamedTuple):
    """One layer's block tables of the last batch read, and what they were built from."""
    rows: np.ndarray  # the requests' rows in the cache's TableColumns
    stamps: np.ndarray  # their page-list stamps then (a stamp changes whenever a page list changes)
    out: list[tuple[PagePool, torch.Tensor]]  # what ``get`` returned
    formats: tuple[str, ...]  # the layer's pools then
    host: dict[str, tuple[PagePool, np.ndarray, np.ndarray]]  # per format: pool, table (spare columns), row lengths
    clock: int  # the columns' page-list clock then (unchanged: no page list of any request changed since)


class BlockTableCache:
    """Each layer's block tables of the last batch read, reused while the batch and its page lists stay the
    same (a decode step reads every layer's tables; most steps change no page list) and patched row by row
    where a few changed — found by comparing page-list stamps, one array operation for the batch."""

    def __init__(self, num_layers: int) -> None:
        self._last: list[_LayerTables | None] = [None] * num_layers

    def get(self, pools: dict[str, PagePool], layer: int, seqs: list[SeqKV], columns: TableColumns,
            rows: np.ndarray) -> list[tuple[PagePool, torch.Tensor]]:
        """Per format used in ``layer`` (``pools``: that layer's): ``(pool, block_table [b, P] int32, -1 padded)``;
        ``rows``: the requests' rows in ``columns``."""
        if len(seqs) == 1:  # no padding to do; the table caches the tensors until its page lists change
            return seqs[0].layers[layer].single_block_tables(lambda flat: [
                (pools[fmt], torch.from_numpy(pages[None]).to(pools[fmt].device))
                for fmt, pages in flat.items() if len(pages)])  # (a format whose pages were all released has none)
        cached = self._last[layer]
        clock = columns.clock
        if cached is not None and cached.clock == clock and (cached.rows is rows or np.array_equal(cached.rows, rows)):
            return cached.out  # no page list changed anywhere since, the same requests: no stamps to compare
        stamps = columns.stamps(layer, rows)
        if cached is not None and len(cached.rows) == len(rows):
            same_row = cached.rows == rows
            changed = np.flatnonzero(~same_row | (cached.stamps != stamps))
            if not len(changed):
                self._last[layer] = cached._replace(rows=rows, clock=clock)
                return cached.out  # same requests, same page lists
            if cached.formats == tuple(pools):
                # rows that only took one page at the end of a format's list since (a page boundary) take it in
                # place; a few others are rewritten from their page lists; otherwise everything is rebuilt
                before, fids, pages = columns.appended(layer, rows[changed])
                append = (fids >= 0) & same_row[changed] & (before == cached.stamps[changed])
                rest = changed[~append].tolist()
                if len(rest) * REWRITE_SHARE <= len(rows):
                    out = self._update(cached.host, changed[append], fids[append], pages[append], columns.fmt_names,
                                       [seqs[i].layers[layer].pages_of_format() for i in rest], rest)
                    if out is not None:
                        self._last[layer] = cached._replace(rows=rows, stamps=stamps, out=out, clock=clock)
                        return out
        per_seq = [s.layers[layer].pages_of_format() for s in seqs]
        host = {}
        out = []
        for fmt, pool in pools.items():
            rows_of = [d.get(fmt, NO_PAGES) for d in per_seq]
            lens = np.fromiter(map(len, rows_of), np.int64, len(rows_of))
            width = int(lens.max(initial=0))
            if width == 0:
                continue
            bt = np.full((len(seqs), 2 * width + 4), -1, np.int32)  # spare columns: every row takes pages over time
            _fill_rows(bt, np.arange(len(seqs)), rows_of, lens)
            host[fmt] = (pool, bt, lens)
            # a copy: the host table is patched in place later, a tensor handed out stays as it was
            out.append((pool, torch.from_numpy(bt[:, :width].copy()).to(pool.device)))
        self._last[layer] = _LayerTables(rows, stamps, out, tuple(pools), host, clock)
        return out

    @staticmethod
    def _update(host, appended: np.ndarray, fids: np.ndarray, pages: np.ndarray, names: tuple[str, ...],
                new_rows: list[dict[str, np.ndarray]], changed: list[int]):
        """The cached tables patched in place: rows ``appended`` take page ``pages[i]`` of format ``fids[i]`` at the
        end of that format's row, rows ``changed`` are rewritten from ``new_rows`` (their page arrays); or None
        (rebuild) when a row outgrows its table's spare columns or holds a format the tables lack."""
        if any(names[f] not in host for f in np.unique(fids).tolist()) or \
                any(f not in host for d in new_rows for f in d):
            return None
        rows = {fmt: [d.get(fmt, NO_PAGES) for d in new_rows] for fmt in host}
        if any(len(r) > host[fmt][1].shape[1] for fmt, rs in rows.items() for r in rs):
            return None
        fid = {fmt: names.index(fmt) if fmt in names else -1 for fmt in host}
        if len(appended):
            for fmt, (_, bt, lens) in host.items():
                sel = appended[fids == fid[fmt]]
                if len(sel) and int(lens[sel].max()) >= bt.shape[1]:
                    return None
        out = []
        idx = np.asarray(changed, np.int64)
        for fmt, (pool, bt, lens) in host.items():
            if len(appended):
                mine = fids == fid[fmt]
                sel = appended[mine]
                bt[sel, lens[sel]] = pages[mine]
                lens[sel] += 1
            if len(idx):
                bt[idx, : int(lens[idx].max(initial=0))] = -1
                lens[idx] = np.fromiter(map(len, rows[fmt]), np.int64, len(idx))
                _fill_rows(bt, idx, rows[fmt], lens[idx])
            width = int(lens.max(initial=0))
            if width:
                out.append((pool, torch.from_numpy(bt[:, :width].copy()).to(pool.device)))
        return out


def _fill_rows(bt: np.ndarray, at: np.ndarray, rows: list[np.ndarray], lens: np.ndarray) -> None:
    """``bt[at[i], :lens[i]] = rows[i]`` for every i, in one scatter."""
    total = int(lens.sum())
    if not total:
        return
    starts = np.cumsum(lens) - lens
    cols = np.arange(total) - np.repeat(starts, lens)
    bt[np.repeat(at, lens), cols] = np.concatenate(rows)
