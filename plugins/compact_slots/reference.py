"""Gather compaction of page lists (R-KV and AMS style): each list's live tokens move to the front of its own
pages, in page-then-slot order, with their codes, key-scale group indices, positions and segment ids; the pages
past each list's live tokens end empty (the caller releases them).

Contract: a pool's ``slot_fields`` (each ``[pages, B, ...]``) and ``k_group [pages, B]`` int32, its slot state
``valid, live, hwm [pages]`` int32, ``slot_pos [pages, B]`` int64 and ``slot_seg [pages, B]`` int32 (all updated in
place; the slot state on the host), ``pages`` int64 (the lists concatenated, every page distinct), ``lens [J]``
int64 (each list's length). ``out_tokens [3, t]`` int64 (``t``: the lists' live tokens) receives each token's
position, new page and new slot, list after list in page-then-slot order; ``out_lists [J + 1]`` int64 each list's
live tokens and, last, how many tokens changed place. A kept page holds its ``n`` tokens in slots ``[0, n)``:
``valid = 2^n - 1``, ``live = hwm = n``; every other slot of the lists' pages reads position and segment -1.
"""
from __future__ import annotations

import numpy as np
import torch


def compact_slots_ref(slot_fields: list[torch.Tensor], k_group: torch.Tensor, valid: torch.Tensor,
                      live: torch.Tensor, hwm: torch.Tensor, slot_pos: torch.Tensor, slot_seg: torch.Tensor,
                      pages: torch.Tensor, lens: torch.Tensor, out_tokens: torch.Tensor,
                      out_lists: torch.Tensor) -> None:
    valid_a, live_a, hwm_a, pos_a, seg_a = (t.numpy() for t in (valid, live, hwm, slot_pos, slot_seg))
    pg, lens_a = pages.numpy(), lens.numpy()
    B = pos_a.shape[1]
    at, ss = np.nonzero((valid_a[pg][:, None] >> np.arange(B, dtype=np.int32)) & 1)  # page, then slot order
    sp = pg[at]
    job = np.repeat(np.arange(len(lens_a)), lens_a)[at]
    counts = np.bincount(job, minlength=len(lens_a))
    i = np.arange(len(sp)) - (np.cumsum(counts) - counts)[job]  # each token's rank in its own list
    dp, ds = pg[(np.cumsum(lens_a) - lens_a)[job] + i // B], i % B
    move = np.flatnonzero((sp != dp) | (ss != ds))
    if len(move):  # by flat slot index: every token read before any is written
        device = k_group.device
        src, dst = (torch.from_numpy(x[move] * B + y[move]).to(device) for x, y in ((sp, ss), (dp, ds)))
        for t in (*slot_fields, k_group):
            flat = t.view(-1, *t.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))
    pos, segs = pos_a[sp, ss], seg_a[sp, ss]  # (copies: fancy indexing)
    valid_a[pg] = 0
    live_a[pg] = 0
    hwm_a[pg] = 0
    pos_a[pg] = -1
    seg_a[pg] = -1
    first = np.flatnonzero(ds == 0)  # each kept page is filled from slot 0: its tokens are one run of dp
    kept, n = dp[first], np.diff(np.append(first, len(dp))).astype(np.int32)
    valid_a[kept] = (np.int64(1) << n) - 1
    live_a[kept] = n
    hwm_a[kept] = n
    pos_a[dp, ds] = pos
    seg_a[dp, ds] = segs
    out_tokens.copy_(torch.from_numpy(np.stack([pos, dp, ds]).astype(np.int64).reshape(3, -1)))
    out_lists[:-1] = torch.from_numpy(counts.astype(np.int64))
    out_lists[-1] = len(move)
