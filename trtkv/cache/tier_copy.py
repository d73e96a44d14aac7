"""Copies of tokens between two caches of one kind (the device cache and its host tiers, ``TierStore``): codes
verbatim in the same format, or dequantized and re-encoded in another."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plugins.formats import get_format
from trtkv.cache.sequence import SeqKV

CacheLike = Any  # a KVCacheManager, device or host (not imported: the manager creates its TierStore)

__all__ = ["raw_copy", "raw_copy_flat", "encode_copy"]


def raw_copy(src: CacheLike, sseq: SeqKV, dst: CacheLike, dseq: SeqKV, layer: int,
              positions: list[int]) -> int:
    """Copy tokens' codes, per-slot scales and key-scale groups verbatim (same format) into ``dst``'s pages.
    The source keeps its copy (the caller frees it). Returns the bytes moved."""
    loc = sseq.layers[layer].loc
    by_cls: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}
    for pos in positions:
        fmt, p, s = loc[pos]
        spool = src.pools[layer][fmt]
        by_cls.setdefault((fmt, int(spool.page_class[p])), []).append((pos, p, s, int(spool.slot_seg[p, s])))
    moved = 0
    for cls, items in by_cls.items():
        spool, dpool = src.pools[layer][cls[0]], dst.pool(layer, cls[0])
        pages, slots = dst.alloc_slots(dseq, layer, cls, len(items))
        sp = torch.tensor([i[1] for i in items], device=spool.device)
        ss = torch.tensor([i[2] for i in items], device=spool.device)
        dp = torch.from_numpy(pages).to(dpool.device)
        ds = torch.from_numpy(slots).to(dpool.device)
        for sf, df in zip(spool.fields, dpool.fields):
            df[dp, ds] = sf[sp, ss].to(dpool.device)
        moved += len(items) * spool.fmt.slot_bytes(spool.H, spool.D)
        if spool.group_specs:
            gids = spool.k_group[sp, ss].cpu().tolist()
            gmap = {}
            for g in sorted(set(gids)):
                ng = dseq.alloc_group(layer, dpool, gids.count(g))
                for sgf, dgf in zip(spool.group_fields, dpool.group_fields):
                    dgf[ng] = sgf[g].to(dpool.device)
                gmap[g] = ng
                moved += dpool.group_bytes
            dpool.k_group[dp, ds] = torch.tensor([gmap[g] for g in gids], dtype=torch.int32, device=dpool.device)
        dst.record_written(dseq, layer, dpool, cls[0], pages, slots, [i[0] for i in items],
                           np.asarray([i[3] for i in items], np.int32))
    return moved


def raw_copy_flat(src: CacheLike, sseqs: list[SeqKV], dst: CacheLike, dseqs: list[SeqKV], layer: int,
                  positions: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``raw_copy`` of the next ``lens[i]`` of ``positions`` (concatenated, all paged in ``src``) from ``sseqs[i]`` to
    ``dseqs[i]`` (formats without key-scale groups): slots allocated as one copy each in turn would (all jobs at
    once when one class is moved; else job by job, each job's classes in the order its tokens list them), the codes
    of every job in one gather and scatter a format. Returns each job's bytes moved."""
    lens = np.asarray(lens, np.int64)
    rows = np.repeat(src.rows(sseqs), lens)
    names, fids, pages, slots, _ = src.locate_flat(layer, rows, positions)
    classes = np.empty(len(positions), np.int64)
    segs = np.empty(len(positions), np.int32)
    for f in np.unique(fids).tolist():
        sel = fids == f
        spool = src.pools[layer][names[f]]
        classes[sel] = spool.page_class[pages[sel]]
        segs[sel] = spool.slot_seg[pages[sel], slots[sel]]
    bounds = np.concatenate([[0], np.cumsum(lens)])
    if len(positions) and (fids == fids[0]).all() and (classes == classes[0]).all():  # one class: every job at once
        dst_pages, dst_slots = dst.alloc_slots_each(dseqs, layer, (names[fids[0]], int(classes[0])), lens)
    else:
        dst_pages, dst_slots = np.empty_like(pages), np.empty_like(slots)
        for j in range(len(lens)):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            for f, c in dict.fromkeys(zip(fids[lo:hi].tolist(), classes[lo:hi].tolist())):
                sel = lo + np.flatnonzero((fids[lo:hi] == f) & (classes[lo:hi] == c))
                dst_pages[sel], dst_slots[sel] = dst.alloc_slots(dseqs[j], layer, (names[f], c), len(sel))
    job = np.repeat(np.arange(len(lens)), lens)
    moved = np.zeros(len(lens), np.int64)
    for f in np.unique(fids).tolist():
        spool, dpool = src.pools[layer][names[f]], dst.pool(layer, names[f])
        sel = np.flatnonzero(fids == f)  # (job by job)
        # (slots as flat rows of [pages * B, ...] views: one index_select and one index_copy_ a field)
        s_at = torch.from_numpy(pages[sel] * spool.B + slots[sel]).to(spool.device)
        d_at = torch.from_numpy(dst_pages[sel] * dpool.B + dst_slots[sel]).to(dpool.device)
        for sf, df in zip(spool.fields, dpool.fields):
            df.view(-1, *df.shape[2:]).index_copy_(0, d_at, sf.view(-1, *sf.shape[2:]).index_select(0, s_at)
                                                   .to(dpool.device))
        counts = np.bincount(job[sel], minlength=len(lens))
        dst.record_written_many(dseqs, counts, layer, dpool, names[f], dst_pages[sel], dst_slots[sel],
                                positions[sel], segs[sel])
        moved += counts * dpool.fmt.slot_bytes(dpool.H, dpool.D)
    return moved


def encode_copy(src: CacheLike, sseq: SeqKV, dst: CacheLike, dseq: SeqKV, layer: int,
                 positions: list[int], fmt_of, thought=None) -> int:
    """Dequantize tokens from ``src`` and encode them into ``dst`` in ``fmt_of(pos)`` (flush groups of the
    format's group size, one thought class and segment per group). Returns the bytes written."""
    loc = sseq.layers[layer].loc
    groups: dict[tuple[str, int, int], list[int]] = {}
    for pos in positions:
        f, p, s = loc[pos]
        spool = src.pools[layer][f]
        th = thought(pos) if thought is not None else int(spool.page_class[p])
        groups.setdefault((fmt_of(pos), th, int(spool.slot_seg[p, s])), []).append(pos)
    moved = 0
    for (fmt, th, seg), plist in groups.items():
        k, v = src.gather_kv(sseq, layer, plist)
        dev = torch.device(dst.cfg.device)
        g = get_format(fmt).group_size if get_format(fmt).group_size > 1 else len(plist)
        for i in range(0, len(plist), max(1, g)):
            dst.write(dseq, layer, k[i:i + g].to(dev), v[i:i + g].to(dev), plist[i:i + g], (fmt, th), seg)
        pool = dst.pools[layer][fmt]
        moved += len(plist) * pool.fmt.slot_bytes(pool.H, pool.D) + pool.group_bytes * -(-len(plist) // max(1, g))
    return moved
