"""A decode step's write-through slots for every layer, allocated at once.

A write-through step stores one token of every request in every layer. Layer by layer, the slot bookkeeping
(open pages, tail slots, validity, position maps) costs a few array operations per layer; with each format's
slot state stacked over the layers (``SlotStack``) and the tables' columns ``[layers, rows]``, the step does
them once for every layer, and each layer's write is then its kernel call alone.

Same slots, same state as ``write_through`` layer after layer: the plan is made when the step's first layer
writes, and is only made when nothing between two layers' writes changes another layer's tables (the policy
has no ``before_attention``, there are no host tiers) and no request of the batch has a reusable (evicted) slot
of the class in any layer (those go through the heaps, request by request). Pages are opened layer by layer in
layer order, as the per-layer writes open them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.cache.block_table import BlockTable, Cls
from trtkv.cache.columns import TableColumns
from trtkv.cache.pool_set import PoolSet
from trtkv.cache.sequence import SeqKV


@dataclass
class WritePlan:
    """Where each request's token goes in every layer: ``pages, slots [layers, batch]`` (on the pools' device)."""
    cls: Cls
    pages: torch.Tensor
    slots: torch.Tensor


def plan_write_through(pools: PoolSet, columns: TableColumns, seqs: list[SeqKV], rows: np.ndarray,
                       positions: np.ndarray, cls: Cls) -> WritePlan | None:
    """Allocate and record the slots of one token of each of ``seqs`` (rows ``rows``, distinct) at ``positions``
    in every layer; None (nothing done) when the plan does not apply (see the module docstring)."""
    fmt = cls[0]
    num_layers = columns.num_layers
    layer_pools = [pools.pool(layer, fmt) for layer in range(num_layers)]
    stack = pools.stack(fmt)
    if stack is None or columns.reuse_anywhere(rows, cls):
        return None
    opens = columns.open_pages_all(rows, cls)
    short = opens < 0
    if short.any():  # page boundaries: fresh pages, layer by layer
        for layer in np.flatnonzero(short.any(1)).tolist():
            BlockTable.open_fresh_pages(lambda i, layer=layer: seqs[i].layers[layer], columns, layer, rows,
                                        np.flatnonzero(short[layer]), layer_pools[layer], cls)
        opens = columns.open_pages_all(rows, cls)
    slots = stack.take_tails(opens)
    closed = slots + 1 >= stack.B
    if closed.any():  # a page's last tail slot: it is no longer the class's open page
        columns.close_rows_all(rows, cls, closed)
    stack.mark_written_distinct(opens, slots, positions)
    columns.place_rows_all(rows, fmt, opens, slots, positions)
    device = layer_pools[0].device
    pages_t, slots_t = torch.from_numpy(opens), torch.from_numpy(slots)
    if device.type != "cpu":
        pages_t, slots_t = pages_t.to(device), slots_t.to(device)
    return WritePlan(cls, pages_t, slots_t)
