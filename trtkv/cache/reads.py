"""What attention and policies read of a request's pages: dequantized K/V of given positions, block tables
per format, and whether a lone request's tokens form one dense run of pages (a view instead of a gather)."""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from trtkv.cache.manager import KVCacheManager, SeqKV
    from trtkv.cache.pool import PagePool


def gather_kv(mgr: KVCacheManager, seq: SeqKV, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized fp32 ``k, v [m, H, D]`` of paged tokens (read-only; for selection, not compaction)."""
    return gather_kv_many(mgr, layer, [(seq, positions)])[0]


def gather_kv_many(mgr: KVCacheManager, layer: int, items: list[tuple[SeqKV, object]], keys_only: bool = False
                   ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`gather_kv` of several requests' positions in one layer, one dequantization per format for
    all of them (a batch's anneals read their keys in one call instead of one per request). ``keys_only``:
    gather and dequantize the key fields alone (values come back None)."""
    sizes = [len(positions) for _, positions in items]
    where = [w for seq, positions in items for w in map(seq.layers[layer].loc.__getitem__, _ints(positions))]
    fmt_of, pages, slots = zip(*where) if where else ((), (), ())  # one pass over the rows
    fmts = set(fmt_of)
    if len(fmts) == 1:  # every row in one format (the common case): no per-row sorting
        by_fmt = {fmt_of[0]: (None, pages, slots)}
    else:  # rows of several formats (or none) land in one output; one format's decode is it
        by_fmt: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for row, (fmt, p, s) in enumerate(where):
            rows, pages, slots = by_fmt.setdefault(fmt, ([], [], []))
            rows.append(row)
            pages.append(p)
            slots.append(s)
        out_k = torch.empty(sum(sizes), mgr.cfg.num_kv_heads, mgr.cfg.head_dim, device=mgr.cfg.device)
        out_v = None if keys_only else torch.empty_like(out_k)
    for fmt, (rows, pages, slots) in by_fmt.items():
        pool = mgr.pools[layer][fmt]
        flat = torch.from_numpy(np.asarray(pages, np.int64) * pool.B + np.asarray(slots, np.int64)).to(pool.device)
        slot = {f.name: t.flatten(0, 1).index_select(0, flat) for f, t in zip(pool.slot_specs, pool.fields)
                if not keys_only or f.name == "k"}
        group = {}
        if pool.group_specs:
            gid = pool.k_group.flatten().index_select(0, flat).long()
            group = {f.name: t.index_select(0, gid) for f, t in zip(pool.group_specs, pool.group_fields)}
        scales = mgr.layer_scales(layer, fmt)
        k, v = (pool.fmt.decode_keys(slot, group, scales), None) if keys_only else pool.fmt.decode(slot, group,
                                                                                                     scales)
        if rows is None:  # every row, in order
            out_k, out_v = k.float(), None if v is None else v.float()
        else:
            idx = torch.tensor(rows, device=pool.device)
            out_k[idx] = k
            if v is not None:
                out_v[idx] = v
    ks = out_k.split(sizes)
    return list(zip(ks, [None] * len(ks) if keys_only else out_v.split(sizes)))


def _ints(positions) -> list[int]:
    return positions.tolist() if hasattr(positions, "tolist") else [int(p) for p in positions]


NO_PAGES = np.empty(0, np.int32)  # a sequence without pages of a format


def block_tables(mgr: KVCacheManager, layer: int, seqs: list[SeqKV]) -> list[tuple[PagePool, torch.Tensor]]:
    """Per format used in this layer: ``(pool, block_table [b, P] int32, -1 padded)``."""
    out = []
    if len(seqs) == 1:  # no padding to do; the tensor is cached until the page list changes
        table = seqs[0].layers[layer]
        if table._bt is None:
            table._bt = [(mgr.pools[layer][fmt], torch.from_numpy(pages[None]).to(mgr.pools[layer][fmt].device))
                         for fmt, pages in table.pages_of_format().items() if len(pages)]  # (a format whose
            # pages were all released, e.g. a tree block re-stored and rebuilt, has no table)
        return table._bt
    per_seq = [s.layers[layer].pages_of_format() for s in seqs]
    cached = mgr._batch_bt[layer]
    if cached is not None and len(cached[0]) == len(per_seq) and all(map(operator.is_, cached[0], per_seq)):
        return cached[1]  # same requests, same page lists (each ``_flat`` is rebuilt when its pages change)
    for fmt, pool in mgr.pools[layer].items():
        rows = [d.get(fmt, NO_PAGES) for d in per_seq]
        width = max((len(r) for r in rows), default=0)
        if width == 0:
            continue
        bt = np.full((len(seqs), width), -1, np.int32)
        for i, r in enumerate(rows):
            bt[i, : len(r)] = r
        out.append((pool, torch.from_numpy(bt).to(pool.device)))
    mgr._batch_bt[layer] = (per_seq, out)  # holds the page arrays it was built from, so identity is safe
    return out


def dense_run(layer: int, seqs: list[SeqKV]) -> tuple[int, int] | None:
    """``(first page, live tokens)`` when a lone request's tokens fill one ascending run of pages from
    its first slot with no hole — then attention can read a view of the pool instead of a gather."""
    if len(seqs) != 1:
        return None
    table = seqs[0].layers[layer]
    if table.holes or len(table.pages) != 1:
        return None
    (pages,) = table.pages.values()
    if not pages or pages[-1] - pages[0] != len(pages) - 1 or any(b - a != 1 for a, b in zip(pages, pages[1:])):
        return None
    return pages[0], table.live
