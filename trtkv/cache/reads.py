"""What attention and policies read of a request's pages: dequantized K/V of given positions, block tables
per format, and whether a lone request's tokens form one dense run of pages (a view instead of a gather)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from trtkv.cache.manager import KVCacheManager, SeqKV
    from trtkv.cache.pool import PagePool


def gather_kv(mgr: KVCacheManager, seq: SeqKV, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized fp32 ``k, v [m, H, D]`` of paged tokens (read-only; for selection, not compaction)."""
    return gather_kv_many(mgr, layer, [(seq, positions)])[0]


def gather_kv_many(mgr: KVCacheManager, layer: int, items: list[tuple[SeqKV, object]]
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`gather_kv` of several requests' positions in one layer, one dequantization per format for
    all of them (a batch's anneals read their keys in one call instead of one per request)."""
    sizes = [len(positions) for _, positions in items]
    by_fmt: dict[str, tuple[list[int], list[int], list[int]]] = {}
    row = 0
    for seq, positions in items:
        loc = seq.layers[layer].loc
        for pos in positions.tolist() if hasattr(positions, "tolist") else positions:
            fmt, p, s = loc[int(pos)]
            rows, pages, slots = by_fmt.setdefault(fmt, ([], [], []))
            rows.append(row)
            pages.append(p)
            slots.append(s)
            row += 1
    if len(by_fmt) != 1:  # rows of several formats (or none) land in one output; one format's decode is it
        out_k = torch.empty(sum(sizes), mgr.cfg.num_kv_heads, mgr.cfg.head_dim, device=mgr.cfg.device)
        out_v = torch.empty_like(out_k)
    for fmt, (rows, pages, slots) in by_fmt.items():
        pool = mgr.pools[layer][fmt]
        flat = torch.tensor(pages, device=pool.device) * pool.B + torch.tensor(slots, device=pool.device)
        slot = {f.name: t.flatten(0, 1).index_select(0, flat) for f, t in zip(pool.slot_specs, pool.fields)}
        group = {}
        if pool.group_specs:
            gid = pool.k_group.flatten().index_select(0, flat).long()
            group = {f.name: t.index_select(0, gid) for f, t in zip(pool.group_specs, pool.group_fields)}
        k, v = pool.fmt.decode(slot, group, mgr.layer_scales(layer, fmt))
        if len(by_fmt) == 1:  # every row, in order
            out_k, out_v = k.float(), v.float()
        else:
            idx = torch.tensor(rows, device=pool.device)
            out_k[idx], out_v[idx] = k, v
    return list(zip(out_k.split(sizes), out_v.split(sizes)))


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
    for fmt, pool in mgr.pools[layer].items():
        rows = [d.get(fmt, NO_PAGES) for d in per_seq]
        width = max((len(r) for r in rows), default=0)
        if width == 0:
            continue
        bt = np.full((len(seqs), width), -1, np.int32)
        for i, r in enumerate(rows):
            bt[i, : len(r)] = r
        out.append((pool, torch.from_numpy(bt).to(pool.device)))
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
