"""The token position behind every column of a decode step's paged-attention logits: what the statistics a
policy asked for are keyed by.

Contract: ``slot_pos [cap, B]`` int64 (a pool's token position in each slot, -1 free), ``block_table [b, P]`` int32
or int64 (the batch's pages, -1 padded) -> ``(positions [b, P * B], counts [b])`` int64: ``positions[i, p * B + s] =
slot_pos[block_table[i, p], s]``, -1 where the table entry is -1; ``counts[i]`` the row's positions >= 0 (the
columns its statistics hold).

``table_positions_layers``: every layer's at once, ``slot_pos [L, cap, B]`` and ``block_tables``, ``L`` tables
``[b, P]`` of one shape (layer ``l``'s pages index ``slot_pos[l]``) -> ``(positions [L, b, P * B], counts [L, b])``.
"""
from __future__ import annotations

import torch


def table_positions_ref(slot_pos: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, P = block_table.shape
    B = slot_pos.shape[1]
    bt = block_table.to(device=slot_pos.device, dtype=torch.int64)
    pos = slot_pos.index_select(0, bt.clamp(min=0).reshape(-1)).view(b, P, B)
    pos = pos.masked_fill((bt < 0)[:, :, None], -1).reshape(b, P * B)
    return pos, (pos >= 0).sum(1)


def table_positions_layers_ref(slot_pos: torch.Tensor, block_tables: list[torch.Tensor]
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    per = [table_positions_ref(sp, bt) for sp, bt in zip(slot_pos, block_tables)]
    return torch.stack([p for p, _ in per]), torch.stack([c for _, c in per])
