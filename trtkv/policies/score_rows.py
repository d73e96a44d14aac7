"""``RowTable``: per-position scores of many requests in one ``[L, rows, positions]`` tensor.

A scorer that accumulates evidence per token (H2O's attention sums) keeps one such table for the whole
engine and gives each request a row, so a decode step adds the batch's attention of a layer in one scatter
and reads the batch's candidate scores in one gather instead of one call per request and layer.
``RowView`` is one request's row with the ``PositionTable`` verbs (``get``, ``add``, ``add_layers``,
``set``), so per-request paths (prefill, a lone event) read and write the same numbers. Copying a view
(``copy.deepcopy``: a forked request's state) gives the copy a row of its own holding the same values.
``HeadRows`` is one request's rows, one per KV head (scores kept per head).
"""
from __future__ import annotations

import numpy as np
import torch

from plugins import ops as plugin_ops

FIRST_ROWS, FIRST_CAP = 8, 64
SCRATCH_ROW = 0  # never handed out (a batch path may point its dead columns at it: nobody reads it back)


class RowTable:
    def __init__(self, num_layers: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.num_layers = num_layers
        with torch.inference_mode(False):  # normal tensors: tree search updates them outside inference mode too
            self.data = torch.zeros((num_layers, FIRST_ROWS, FIRST_CAP), dtype=dtype, device=device)
        self._free = list(range(FIRST_ROWS - 1, SCRATCH_ROW, -1))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def cap(self) -> int:
        return self.data.shape[-1]

    def acquire(self) -> RowView:
        if not self._free:
            rows = self.data.shape[1]
            with torch.inference_mode(False):
                self.data = torch.cat([self.data, torch.zeros_like(self.data)], dim=1)
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self.data[:, row] = 0
        return RowView(self, row)

    def release(self, row: int) -> None:
        self._free.append(row)

    def ensure(self, max_pos: int) -> None:
        cap = self.cap
        if max_pos < cap:
            return
        with torch.inference_mode(False):
            grown = torch.zeros((*self.data.shape[:2], max(2 * cap, max_pos + 1)), dtype=self.data.dtype,
                                device=self.device)
            grown[..., :cap] = self.data
        self.data = grown

    def add_rows(self, layer: int, rows: np.ndarray, positions: np.ndarray, values: torch.Tensor) -> None:
        """``values [b, n]`` added at ``positions [b, n]`` (distinct per row; -1: skip) of ``rows [b]``, in one
        ``scatter_add_rows`` (plugins/scatter_add_rows)."""
        self._scatter_add(rows, positions[None], values[None], layer)

    def flat(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Indices into a layer's flattened ``[rows, cap]`` data of ``positions`` (>= 0, any shape) of ``rows``
        (one per leading row of ``positions``, or already broadcast to its shape); grows the table first."""
        if positions.size:
            self.ensure(int(positions.max()))
        return (rows[:, None] if rows.ndim < positions.ndim else rows) * self.cap + positions

    def take(self, layer: int, flat: np.ndarray) -> torch.Tensor:
        """The values at ``flat`` (``flat``'s indices, 1-D)."""
        return self.data[layer].view(-1).index_select(0, torch.from_numpy(flat).to(self.device))

    def put(self, layer: int, flat: np.ndarray, values: torch.Tensor) -> None:
        """Set the values at ``flat`` (distinct, 1-D)."""
        self.data[layer].view(-1).index_copy_(0, torch.from_numpy(flat).to(self.device),
                                              values.to(self.device, self.data.dtype))

    def get_rows(self, layer: int, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """``[b, n]`` scores at ``positions [b, n]`` (>= 0) of ``rows [b]``."""
        self.ensure(int(positions.max(initial=0)))
        flat = torch.from_numpy((rows[:, None] * self.cap + positions).reshape(-1)).to(self.device)
        return self.data[layer].view(-1).index_select(0, flat).view(positions.shape)

    def add_rows_layers(self, rows: np.ndarray, positions: np.ndarray, values: torch.Tensor, top: int | None = None
                        ) -> None:
        """``add_rows`` of every layer at once: ``values [L, b, n]`` at ``positions [L, b, n]`` (-1: skip); ``top``:
        a bound on the positions, when the caller knows one (saves a pass over them)."""
        self._scatter_add(rows, positions, values, 0, top)

    def add_rows_folded(self, layer: int, rows: np.ndarray, positions: list[np.ndarray], values: list[torch.Tensor],
                        divisor: np.ndarray, top: int = -1) -> None:
        """``values[l] [b, n_l] / divisor [b]`` added at ``positions[l] [b, n_l]`` (-1: skip) of ``rows [b]``, every
        ``l`` into ``layer``, in order (``fold_add_rows``: what a call of ``add_rows`` with the quotients a layer adds,
        rounding included). ``top``: a bound on the positions, when the caller knows one (saves a pass over them)."""
        if top < 0:
            top = max((int(p.max(initial=-1)) for p in positions), default=-1)
        if top < 0:
            return
        self.ensure(top)
        plugin_ops.fold_add_rows(self.data, torch.from_numpy(np.ascontiguousarray(rows, np.int64)),
                                 [torch.from_numpy(np.ascontiguousarray(p, np.int64)) for p in positions], values,
                                 torch.from_numpy(np.ascontiguousarray(divisor, np.float64)), layer)

    def _scatter_add(self, rows: np.ndarray, positions: np.ndarray, values: torch.Tensor, layer0: int,
                     top: int | None = None) -> None:
        """``values [L, b, n]`` added at ``positions [L, b, n]`` (-1: skip) of ``rows [b]`` in layers
        ``layer0..layer0 + L - 1``; grows the table first (to ``top``, else to the largest position)."""
        top = int(positions.max(initial=-1)) if top is None else top
        if top < 0:
            return
        self.ensure(top)
        plugin_ops.scatter_add_rows(self.data, torch.from_numpy(np.ascontiguousarray(rows, np.int64)),
                                    torch.from_numpy(np.ascontiguousarray(positions, np.int64)), values, layer0)

    def get_rows_layers(self, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """``get_rows`` of every layer at once: ``[L, b, n]`` scores at ``positions [L, b, n]`` (-1: a dead column,
        read as 0), in one pass (``gather_rows``). On CPU the read checks its positions against the table's width,
        and only when one is past it (never written, so 0) does the table grow and the read run again; a device
        read must not index past the table, so there the table grows first."""
        args = (torch.from_numpy(np.ascontiguousarray(rows, np.int64)),
                torch.from_numpy(np.ascontiguousarray(positions, np.int64)), 0)
        if self.device.type == "cpu":
            try:
                return plugin_ops.gather_rows(self.data, *args)
            except (RuntimeError, IndexError):  # a position past the width (gather_rows' check; index_select's)
                pass
        self.ensure(int(positions.max(initial=0)))
        return plugin_ops.gather_rows(self.data, *args)

    def lowest_rows_layers(self, rows: np.ndarray, positions: np.ndarray, bound: np.ndarray) -> np.ndarray:
        """Per layer and row of ``positions [L, b, n]`` (-1: a dead column), the position of the lowest score below
        ``bound [b]`` (``table_victims``: ``get_rows_layers`` then ``lowest_victim``'s rules in one pass; a position
        past the width reads 0), ``[L, b]``, -1 none."""
        return plugin_ops.table_victims(self.data, torch.from_numpy(np.ascontiguousarray(rows, np.int64)),
                                        torch.from_numpy(np.ascontiguousarray(positions, np.int64)),
                                        torch.from_numpy(np.ascontiguousarray(bound, np.int64)), 0).cpu().numpy()


class RowView:
    """One request's row of a ``RowTable``, with ``PositionTable``'s verbs."""

    def __init__(self, table: RowTable, row: int) -> None:
        self.table, self.row = table, row

    @property
    def device(self) -> torch.device:
        return self.table.device

    def _index(self, positions) -> torch.Tensor:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if len(pos):
            self.table.ensure(int(pos.max()))
        return torch.from_numpy(pos).to(self.device)

    def get(self, layer: int, positions) -> torch.Tensor:
        idx = self._index(positions)  # (first: it may grow the table)
        return self.table.data[layer, self.row].index_select(-1, idx)

    def values(self, layer: int) -> torch.Tensor:
        """Every position's value in ``layer`` (a view; positions past the table's width are 0)."""
        return self.table.data[layer, self.row]

    def add(self, layer: int, positions, values: torch.Tensor) -> None:
        idx = self._index(positions)
        self.table.data[layer, self.row].index_add_(-1, idx, values.to(self.device, self.table.data.dtype))

    def add_layers(self, items: list[tuple[int, np.ndarray, torch.Tensor]]) -> None:
        """``add`` of several ``(layer, positions [n], values [n])`` in one scatter."""
        pos = [np.asarray(p, np.int64) for _, p, _ in items]
        lens = [len(p) for p in pos]
        if not sum(lens):
            return
        flat = np.concatenate(pos)
        self.table.ensure(int(flat.max()))
        rows, cap = self.table.data.shape[1], self.table.cap
        flat += np.repeat(np.fromiter(((layer * rows + self.row) * cap for layer, _, _ in items), np.int64,
                                      len(items)), lens)
        vals = torch.cat([v.to(self.device, self.table.data.dtype) for _, _, v in items])
        self.table.data.view(-1).index_add_(0, torch.from_numpy(flat).to(self.device), vals)

    def set(self, layer: int, positions, values) -> None:
        idx = self._index(positions)
        if isinstance(values, torch.Tensor):
            values = values.to(self.device, self.table.data.dtype)
        self.table.data[layer, self.row, idx] = values

    def release(self) -> None:
        self.table.release(self.row)
        self.row = -1

    def __deepcopy__(self, memo) -> RowView:
        twin = self.table.acquire()
        self.table.data[:, twin.row] = self.table.data[:, self.row]
        return twin


class HeadRows:
    """One request's rows of a ``RowTable``, one per KV head: ``PositionTable``'s ``get`` and ``add`` over ``[H, n]``
    values (R-KV's importance), so a decode step adds the batch's ``[b, H, n]`` in one scatter of ``b * H`` rows.
    Copying it (``copy.deepcopy``: a forked request's state) gives the copy rows of its own holding the same values."""

    def __init__(self, table: RowTable, rows: np.ndarray) -> None:
        self.table, self.rows = table, rows

    @classmethod
    def acquire(cls, table: RowTable, heads: int) -> HeadRows:
        return cls(table, np.fromiter((table.acquire().row for _ in range(heads)), np.int64, heads))

    def _index(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if len(pos):
            self.table.ensure(int(pos.max()))  # (first: it may grow the table)
        device = self.table.device
        return torch.from_numpy(self.rows).to(device), torch.from_numpy(pos).to(device)

    def get(self, layer: int, positions) -> torch.Tensor:
        rows, idx = self._index(positions)
        return self.table.data[layer].index_select(0, rows).index_select(-1, idx)

    def add(self, layer: int, positions, values: torch.Tensor) -> None:
        """Add ``values [H, n]`` at distinct ``positions [n]``."""
        rows, idx = self._index(positions)
        self.table.data[layer].index_put_((rows[:, None], idx[None, :]),
                                          values.to(self.table.device, self.table.data.dtype), accumulate=True)

    def release(self) -> None:
        for row in self.rows.tolist():
            self.table.release(row)
        self.rows = self.rows[:0]

    def __deepcopy__(self, memo) -> HeadRows:
        twin = HeadRows.acquire(self.table, len(self.rows))
        self.table.data[:, twin.rows] = self.table.data[:, self.rows]
        return twin
