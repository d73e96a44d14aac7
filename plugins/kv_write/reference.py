"""Torch reference for kv_write: quantize one flush group, pack it and scatter it into slots."""
from __future__ import annotations

import torch

from plugins.formats import LayerScales, format_by_code
from plugins.formats.base import field_names


def kv_write_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_fields: list[torch.Tensor],
    group_fields: list[torch.Tensor],
    k_group: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
    gid: int,
    fmt_code: int,
    scale_k: float,
    scale_v: float,
) -> None:
    """Write ``n`` tokens ``k, v [n, H, D]`` into ``(pages[i], slots[i])``; only those slots change.

    Write-through formats (group_size 1) may write tokens of several sequences in one call; a
    quantized format writes exactly one flush group, whose key scales go to arena entry ``gid``.
    """
    fmt = format_by_code(fmt_code)
    slot_enc, group_enc = fmt.encode(k, v, LayerScales(scale_k, scale_v))
    names, gnames = field_names(fmt_code)
    if pages.numel() == 1 and pages.device.type == "cpu":  # one token: a view copy beats index_put
        p, s = int(pages), int(slots)
        for name, pool in zip(names, slot_fields):
            pool[p, s] = slot_enc[name][0]
    else:
        p, s = pages.long(), slots.long()
        for name, pool in zip(names, slot_fields):
            pool[p, s] = slot_enc[name]
    if group_fields:
        for name, arena in zip(gnames, group_fields):
            arena[gid] = group_enc[name]
        k_group[pages.long(), slots.long()] = gid


def kv_write_groups_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_fields: list[torch.Tensor],
    group_fields: list[torch.Tensor],
    k_group: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
    gids: torch.Tensor,
    fmt_code: int,
    scale_k: float,
    scale_v: float,
) -> None:
    """``G`` flush groups at once: ``k, v [G, n, H, D]`` into ``(pages[j], slots[j])`` (``[G, n]``), group
    ``j``'s key scales to arena entry ``gids[j]`` — exactly ``kv_write_ref`` of each group in turn."""
    for j, gid in enumerate(gids.tolist()):
        kv_write_ref(k[j], v[j], slot_fields, group_fields, k_group, pages[j], slots[j], gid, fmt_code, scale_k,
                     scale_v)
