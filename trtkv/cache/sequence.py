"""``SeqKV``: the cache's record of one request — a block table per layer, its residual buffer, its bytes."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from trtkv.cache.accounting import ByteAccount
from trtkv.cache.block_table import BlockTable
from trtkv.cache.columns import TableColumns
from trtkv.cache.pool import PagePool
from trtkv.cache.residual import ResidualBuffer
from trtkv.errors import OutOfKVMemory

NO_POSITIONS: list[int] = []  # the buffered positions of a request without a residual buffer


class SeqKV:
    """Cache state of one request. ``kv_bytes``: pages + key-scale groups + residual buffer, as charged."""

    def __init__(self, seq_id: int, num_layers: int, order: Iterator[int], cols: TableColumns, row: int,
                 residual: ResidualBuffer | None = None):
        self.seq_id = seq_id
        self.row = row  # this request's row in the cache's TableColumns
        self._cols = cols
        self.account = ByteAccount()
        self.layers = [BlockTable(seq_id, layer, self.account, order, cols, row) for layer in range(num_layers)]
        self.residual = residual
        self.fork_mode: str | None = None  # set once the sequence shares pages: "cow" or "tree" (cache/forks.py)
        if residual is not None:
            self.account.add(residual.nbytes)

    # --- bytes -----------------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        return self.account.bytes

    @property
    def peak_bytes(self) -> int:
        return self.account.peak

    def add_bytes(self, n: int) -> None:
        self.account.add(n)

    def alloc_group(self, layer: int, pool: PagePool, n: int) -> int:
        """A key-scale arena entry for a group of ``n`` tokens (-1: the format has none), charged to this
        request; a full arena names the request and layer."""
        try:
            gid = pool.alloc_group(n)
        except OutOfKVMemory as e:
            raise e.at(self.seq_id, layer, pool.fmt.name) from None
        if gid >= 0:
            self.account.add(pool.group_bytes)
        return gid

    # --- residual buffer ---------------------------------------------------------------------------
    @property
    def buf_k(self) -> torch.Tensor | None:
        """``[L, g, H, D]`` residual keys (a view of the arena row), None without a buffer."""
        return None if self.residual is None else self.residual.k

    @property
    def buf_v(self) -> torch.Tensor | None:
        return None if self.residual is None else self.residual.v

    def buffered_positions(self, layer: int) -> list[int]:
        """Positions in the residual buffer of ``layer`` (read-only)."""
        return NO_POSITIONS if self.residual is None else self.residual.positions(layer)

    def buffered(self, layer: int = 0) -> int:
        return 0 if self.residual is None else self.residual.count(layer)

    # --- evictions -----------------------------------------------------------------------------------
    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted, summed over layers (a column of the cache's TableColumns)."""
        return self._cols.evicted(self.row)

    def count_evicted(self, n: int) -> None:
        self._cols.count_evicted(np.array([self.row]), n)
