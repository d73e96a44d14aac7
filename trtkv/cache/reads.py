"""What attention and policies read of a request's pages: dequantized K/V of given positions, block tables
per format, and whether a lone request's tokens form one dense run of pages (a view instead of a gather)."""
from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np
import torch

from trtkv.cache.pool import PagePool
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.sequence import SeqKV


def gather_kv_many(pools: PoolSet, layer: int, items: list[tuple[SeqKV, object]], keys_only: bool = False
                   ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Dequantized fp32 ``k, v [m, H, D]`` of several requests' paged positions in one layer (read-only; for
    selection, not compaction), one dequantization per format for all of them (a batch's anneals read their
    keys in one call instead of one per request). ``keys_only``: gather and dequantize the key fields alone
    (values come back None)."""
    cfg = pools.cfg
    sizes = [len(positions) for _, positions in items]
    by_fmt = _slots_by_search(pools[layer], layer, items)
    if by_fmt is None:
        by_fmt = _slots_by_lookup(pools[layer], layer, items)
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


SEARCH_SPAN_MAX = 1 << 16  # requests x position span up to which _slots_by_search's inverse table is built


def _slots_by_search(pools: dict[str, PagePool], layer: int, items
                     ) -> dict[str, tuple[np.ndarray | None, np.ndarray]] | None:
    """``{format: (rows, page * B + slot)}`` of the requested positions, found in the requests' own pages by
    their slot positions (``PagePool.slot_pos``) with array operations: an inverse table over each request's
    span of asked positions instead of a dictionary lookup per row (a batch's anneal reads ~2,000 rows a
    layer). None, for the lookup path, where a request is forked (its shared pages' slots are not its own
    alone) or the spans are too wide."""
    seqs = [seq for seq, _ in items]
    if len(items) < 2 or any(s.fork_mode is not None for s in seqs):
        return None
    pos = [np.asarray(p, np.int64).reshape(-1) for _, p in items]
    sizes = [len(p) for p in pos]
    if not any(sizes):
        return None
    lo = np.array([p.min() if len(p) else 0 for p in pos])
    span = max(int(p.max()) - int(p.min()) for p in pos if len(p)) + 1
    if span * len(items) > SEARCH_SPAN_MAX:
        return None
    tables = [s.layers[layer].pages_of_format() for s in seqs]
    fmts = sorted({f for t in tables for f, pages in t.items() if len(pages)})
    inv = np.full(len(items) * span, -1, np.int64)
    fmt_at = np.zeros(len(items) * span, np.int8) if len(fmts) > 1 else None
    for i, fmt in enumerate(fmts):
        pool = pools[fmt]
        pages = [t.get(fmt, NO_PAGES) for t in tables]
        owner = np.repeat(np.arange(len(items)), [len(p) for p in pages])
        held = np.concatenate(pages).astype(np.int64)
        at = pool.slot_pos[held] - lo[owner][:, None]  # [pages, B]: position - the request's lowest asked
        ok = (at >= 0) & (at < span)  # (a free slot's -1 is below every asked position)
        key = (owner[:, None] * span + at)[ok]
        inv[key] = (held[:, None] * pool.B + np.arange(pool.B))[ok]
        if fmt_at is not None:
            fmt_at[key] = i
    owner = np.repeat(np.arange(len(items)), sizes)
    q = np.concatenate(pos)
    key = owner * span + (q - lo[owner])
    flat = inv[key]
    missing = flat < 0
    if missing.any():  # what the position map would say of a position not in pages
        raise KeyError(int(q[np.argmax(missing)]))
    if fmt_at is None:
        return {fmts[0]: (None, flat)}
    which = fmt_at[key]
    out = {fmt: (rows, flat[rows]) for i, fmt in enumerate(fmts) if len(rows := np.flatnonzero(which == i))}
    return {fmt: (None, flat) for fmt in out} if len(out) == 1 else out  # one format: every row, in order


def _slots_by_lookup(pools: dict[str, PagePool], layer: int, items
                     ) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
    """``_slots_by_search``'s answer from each request's position map, one lookup per row."""
    where = [w for seq, positions in items for w in map(seq.layers[layer].loc.__getitem__, _ints(positions))]
    fmt_of, pages, slots = zip(*where) if where else ((), (), ())  # one pass over the rows
    pages, slots = np.asarray(pages, np.int64), np.asarray(slots, np.int64)
    fmts = sorted(set(fmt_of))
    if len(fmts) == 1:  # every row in one format (the common case): no per-row sorting
        return {fmts[0]: (None, pages * pools[fmts[0]].B + slots)}
    fmt_of = np.asarray(fmt_of)
    out = {}
    for fmt in fmts:
        rows = np.flatnonzero(fmt_of == fmt)
        out[fmt] = (rows, pages[rows] * pools[fmt].B + slots[rows])
    return out


def _ints(positions) -> list[int]:
    return positions.tolist() if hasattr(positions, "tolist") else [int(p) for p in positions]


NO_PAGES = np.empty(0, np.int32)  # a sequence without pages of a format
REWRITE_SHARE = 8  # a batch's cached block tables are patched row by row when at most 1/8 of its rows changed


class _LayerTables(NamedTuple):
    """One layer's block tables of the last batch read, and what they were built from."""
    per_seq: list[dict[str, np.ndarray]]  # each request's page arrays (identity tells a changed row)
    out: list[tuple[PagePool, torch.Tensor]]  # what ``get`` returned
    formats: tuple[str, ...]  # the layer's pools then
    host: dict[str, tuple[PagePool, np.ndarray, np.ndarray]]  # per format: pool, table (spare columns), row lengths


class BlockTableCache:
    """Each layer's block tables of the last batch read, reused while the batch and its page lists stay the
    same (a decode step reads every layer's tables; most steps change no page list)."""

    def __init__(self, num_layers: int) -> None:
        self._last: list[_LayerTables | None] = [None] * num_layers

    def get(self, pools: dict[str, PagePool], layer: int, seqs: list[SeqKV]) -> list[tuple[PagePool, torch.Tensor]]:
        """Per format used in ``layer`` (``pools``: that layer's): ``(pool, block_table [b, P] int32, -1 padded)``."""
        if len(seqs) == 1:  # no padding to do; the table caches the tensors until its page lists change
            return seqs[0].layers[layer].single_block_tables(lambda flat: [
                (pools[fmt], torch.from_numpy(pages[None]).to(pools[fmt].device))
                for fmt, pages in flat.items() if len(pages)])  # (a format whose pages were all released has none)
        per_seq = [s.layers[layer].pages_of_format() for s in seqs]
        cached = self._last[layer]
        if cached is not None and len(cached.per_seq) == len(per_seq):
            same = list(map(operator.is_, cached.per_seq, per_seq))
            if all(same):
                return cached.out  # same requests, same page lists (a table rebuilds its arrays when its pages change)
            if cached.formats == tuple(pools) and same.count(False) * REWRITE_SHARE <= len(same):
                changed = [i for i, x in enumerate(same) if not x]  # a few rows changed: rewrite those alone
                out = self._update(cached.host, per_seq, changed)
                if out is not None:
                    self._last[layer] = cached._replace(per_seq=per_seq, out=out)
                    return out
        host = {}
        out = []
        for fmt, pool in pools.items():
            rows = [d.get(fmt, NO_PAGES) for d in per_seq]
            lens = np.fromiter(map(len, rows), np.int64, len(rows))
            width = int(lens.max(initial=0))
            if width == 0:
                continue
            bt = np.full((len(seqs), width + width // 4 + 1), -1, np.int32)  # spare columns: pages join rows often
            for i, r in enumerate(rows):
                bt[i, : len(r)] = r
            host[fmt] = (pool, bt, lens)
            # a copy: the host table is patched in place later, a tensor handed out stays as it was
            out.append((pool, torch.from_numpy(bt[:, :width].copy()).to(pool.device)))
        # holds the page arrays it was built from, so identity is safe
        self._last[layer] = _LayerTables(per_seq, out, tuple(pools), host)
        return out

    @staticmethod
    def _update(host, per_seq: list[dict[str, np.ndarray]], changed: list[int]):
        """The cached tables with rows ``changed`` rewritten in place, or None (rebuild) when a row outgrows its
        table's spare columns or holds a format the tables lack."""
        if any(f not in host for i in changed for f in per_seq[i]):
            return None
        rows = {fmt: [per_seq[i].get(fmt, NO_PAGES) for i in changed] for fmt in host}
        if any(len(r) > host[fmt][1].shape[1] for fmt, rs in rows.items() for r in rs):
            return None
        out = []
        for fmt, (pool, bt, lens) in host.items():
            for i, r in zip(changed, rows[fmt]):
                bt[i, : len(r)] = r
                bt[i, len(r): lens[i]] = -1
                lens[i] = len(r)
            width = int(lens.max(initial=0))
            if width:
                out.append((pool, torch.from_numpy(bt[:, :width].copy()).to(pool.device)))
        return out
