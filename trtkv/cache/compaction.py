"""Gather compaction (R-KV and AMS style): after an eviction, move a request's live tokens of every class to
the front of its pages and release the emptied pages. It copies K/V codes; the in-place mode never does."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from trtkv.cache import forks

if TYPE_CHECKING:
    from trtkv.cache.manager import KVCacheManager, SeqKV


def compact(mgr: KVCacheManager, seq: SeqKV, layer: int) -> None:
    """Move every class's live tokens of ``seq`` in ``layer`` to the front of its pages and free the rest."""
    table = seq.layers[layer]
    for cls, pages in list(table.pages.items()):  # gathering writes: shared pages are copied first
        for p in [p for p in pages if mgr.refs.sharers(layer, cls[0], p)]:
            forks.make_private(mgr, seq, layer, cls[0], p)
    for cls, pages in list(table.pages.items()):
        pool = mgr.pools[layer][cls[0]]
        src = [(p, s) for p in pages for s in range(pool.B) if pool.valid[p] >> s & 1]
        dst = [(pages[i // pool.B], i % pool.B) for i in range(len(src))]
        moves = [(a, b) for a, b in zip(src, dst) if a != b]
        if moves:
            sp = torch.tensor([a[0] for a, _ in moves], device=pool.device)
            ss = torch.tensor([a[1] for a, _ in moves], device=pool.device)
            dp = torch.tensor([b[0] for _, b in moves], device=pool.device)
            ds = torch.tensor([b[1] for _, b in moves], device=pool.device)
            for t in pool.fields:
                t[dp, ds] = t[sp, ss].clone()
            pool.k_group[dp, ds] = pool.k_group[sp, ss].clone()
            mgr.compaction_moves += len(moves)
        pos = [int(pool.slot_pos[p, s]) for p, s in src]
        segs = [int(pool.slot_seg[p, s]) for p, s in src]
        keep_pages = pages[: (len(src) + pool.B - 1) // pool.B]
        for p in pages:
            pool.valid[p] = 0
            pool.live[p] = 0
            pool.hwm[p] = 0
            pool.slot_pos[p] = -1
            pool.slot_seg[p] = -1
        for i, ((p, s), q) in enumerate(zip(dst, pos)):
            pool.valid[p] |= np.int32(1 << s)
            pool.live[p] += 1
            pool.hwm[p] = max(pool.hwm[p], s + 1)
            pool.slot_pos[p, s] = q
            pool.slot_seg[p, s] = segs[i]
            table.loc[q] = (cls[0], p, s)
        pool._valid_dirty = True
        for p in pages[len(keep_pages):]:
            del table.page_seq[(cls[0], p)]
            pool.release_page(p)
            seq.add_bytes(-(pool.page_bytes + 4))
        table.pages[cls] = list(keep_pages)
        table.reusable[cls] = []
        table.open_page.pop(cls, None)
        if keep_pages and pool.hwm[keep_pages[-1]] < pool.B:
            table.open_page[cls] = keep_pages[-1]
        table._flat = table._bt = None
