"""Paged keys read back dequantized: the slots a selection asks for (ThinKV's anneal, AMS's evidence), each
key's codes and its flush group's statistics decoded to fp32.

Contract: ``slot_fields`` / ``group_fields`` / ``k_group`` of one pool (``PagePool``: fields ``[P, B, ...]``, key
statistics ``[G, H, D]``, ``k_group [P, B]`` the group of each slot), ``flat [m]`` int64 slot ids ``page * B +
slot``, the format's code and the layer's key scale -> ``[m, H, D]`` fp32: exactly ``fmt.decode_keys`` of the
gathered fields (the formats' torch decoders define the values; every step is fp32, in their order).
"""
from __future__ import annotations

import torch

from plugins.formats import format_by_code
from plugins.formats.base import LayerScales, field_names


def gather_keys_ref(slot_fields: list[torch.Tensor], group_fields: list[torch.Tensor], k_group: torch.Tensor,
                    flat: torch.Tensor, fmt_code: int, scale_k: float) -> torch.Tensor:
    fmt = format_by_code(fmt_code)
    slot_names, group_names = field_names(fmt_code)
    slot = {"k": slot_fields[slot_names.index("k")].flatten(0, 1).index_select(0, flat)}
    group = {}
    if group_fields:
        gid = k_group.flatten().index_select(0, flat).long()
        group = {name: t.index_select(0, gid) for name, t in zip(group_names, group_fields)}
    return fmt.decode_keys(slot, group, LayerScales(k=scale_k)).float()
