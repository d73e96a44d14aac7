"""The request API: everything a policy may see of, and ask of, one request's KV cache.

Policies speak in absolute token positions and never in pages: the runtime hands every hook an object that
implements :class:`PolicyRequest` (``trtkv.runtime.context.RequestContext``), and that object is the only
door into the cache. Paged tokens live in pages (possibly quantized); *buffered* tokens are the
full-precision residual group of quantized formats, attended and counted but not evictable until flushed.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class PolicyRequest(Protocol):
    """One request as a policy sees it. Shapes: ``positions [n]`` int64 ascending; ``k, v [n, H, D]`` fp32."""

    req_id: int
    prompt_len: int
    step: int  # decode index of the token being processed (-1 during prefill)
    state: Any  # the policy's per-request State (a dataclass), created and freed by the base policy
    tree: Any  # the search tree (``trtkv.policies.tree.TreeView``) this request is a node of, else None

    # --- geometry -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def num_q_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def position(self) -> int:
        """Absolute position of the token processed in the current step."""
    @property
    def eviction_mode(self) -> str:
        """How the cache executes evictions: "inplace" (slot reuse) or "compact" (gather)."""

    # --- what is held ------------------------------------------------------------------------
    def live_positions(self, layer: int) -> np.ndarray:
        """Paged positions of one layer, ascending (the residual buffer is not included)."""
    def live_positions_in(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """``live_positions`` within ``[lo, hi)`` (a segment's members), without listing the others."""
    def buffered_positions(self, layer: int) -> np.ndarray:
        """Positions in the full-precision residual buffer of one layer (never evictable)."""
    def all_positions(self, layer: int) -> np.ndarray:
        """Paged and buffered positions of one layer, ascending."""
    def num_live(self, layer: int) -> int:
        """Tokens one layer attends: paged + buffered."""
    def num_paged(self, layer: int) -> int: ...
    def num_buffered(self, layer: int) -> int: ...
    def stored_formats(self, layer: int) -> Counter:
        """Storage format name -> number of paged tokens of one layer in it."""

    # --- reads and actions -------------------------------------------------------------------
    def kv(self, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized post-RoPE ``k, v [m, H, D]`` fp32 of paged *or* buffered positions (read-only)."""
    def kv_rows(self, layer: int, reqs: list["PolicyRequest"], positions: np.ndarray
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv`` of paged ``positions[i] [n]`` of ``reqs[i]`` (requests of this one's batch) in one read:
        ``k, v [len(reqs), n, H, D]``."""
    def keys_rows(self, layer: int, reqs: list["PolicyRequest"], positions: np.ndarray) -> torch.Tensor:
        """``kv_rows``' keys alone: ``[len(reqs), n, H, D]``."""
    def keys(self, layer: int, positions) -> torch.Tensor: ...
    def keys_padded(self, layer: int, jobs: list[tuple["PolicyRequest", Any]], rows: int) -> torch.Tensor:
        """``keys`` of ``(request, positions)`` jobs of requests in this one's batch as one ``[J, rows, H, D]``
        tensor (job j's in its first rows, zeros after), in one read per storage format (a batch hook's
        selection reads every request's keys at once)."""
    def keys_padded_flat(self, layer: int, reqs: list["PolicyRequest"], positions: np.ndarray, counts: np.ndarray,
                         rows: int) -> torch.Tensor:
        """``keys_padded`` with the jobs' positions concatenated: ``counts[j]`` of ``positions`` are job ``j``'s, of
        ``reqs[j]`` (no array per job)."""
    def evict(self, layer: int, positions) -> int:
        """Evict paged positions of one layer (buffered ones are ignored); returns how many went. With the
        cache setting ``demote=host|host-<format>`` the victims move to a host tier instead (still attended)."""
    def evict_many(self, layer: int, jobs: list[tuple["PolicyRequest", Any]]) -> list[int]:
        """``evict`` of ``(request, positions)`` jobs of requests in this one's batch, in one pass (a batch
        hook's anneal evicts from every request at once); returns each job's count."""
    def evict_flat(self, layer: int, reqs: list["PolicyRequest"], positions: np.ndarray, lens: np.ndarray) -> list[int]:
        """``evict_many`` with the victims concatenated: ``lens[i]`` of ``positions`` are job ``i``'s, of ``reqs[i]``
        (a request may repeat); no array per job."""
    def evict_each(self, layer: int, reqs: list["PolicyRequest"], positions: np.ndarray) -> None:
        """``evict`` of ``positions[i]`` (one position each, -1 none) of ``reqs[i]`` (distinct requests of this
        one's batch) in one layer, by array operations where the cache allows; passing the same list object
        for every layer of a step lets the cache reuse its row lookup."""
    def evict_each_layers(self, layers: np.ndarray, reqs: list["PolicyRequest"], positions: np.ndarray) -> None:
        """``evict_each`` in each of ``layers`` (ascending, distinct) with ``positions [len(layers), len(reqs)]``:
        the same as calling it layer by layer, in one pass over every layer where the cache allows."""
    def evict_rows_layers(self, reqs: list["PolicyRequest"], positions: np.ndarray) -> None:
        """``positions [layers, len(reqs), m]`` (distinct within a request, -1 none) of ``reqs`` (distinct requests of
        this one's batch) in every layer: ``evict_flat`` of each layer in turn, in one pass where the cache allows."""
    def num_live_many(self, layer: int, reqs: list["PolicyRequest"]) -> np.ndarray:
        """``num_live(layer)`` of each of ``reqs`` (requests of this one's batch), as one array read. Passing
        the same list object for every layer of a step lets the cache reuse its row lookup."""
    def num_live_layers(self, reqs: list["PolicyRequest"]) -> np.ndarray:
        """``num_live_many`` of every layer at once: ``[L, len(reqs)]``."""
    def num_paged_many(self, layer: int, reqs: list["PolicyRequest"]) -> np.ndarray:
        """``num_paged(layer)`` of each of ``reqs``, as one array read (like ``num_live_many``)."""
    def num_paged_layers(self, reqs: list["PolicyRequest"]) -> np.ndarray:
        """``num_paged_many`` of every layer at once: ``[L, len(reqs)]``."""
    def num_buffered_many(self, layer: int, reqs: list["PolicyRequest"]) -> np.ndarray:
        """``num_buffered(layer)`` of each of ``reqs``, as one array read (like ``num_live_many``)."""
    def live_positions_each(self, layer: int, reqs: list["PolicyRequest"], which: np.ndarray, n: int) -> np.ndarray:
        """``[len(which), n]``: ``live_positions(layer)`` of ``reqs[which[i]]``, which each hold exactly ``n``
        paged tokens, in one array read."""
    def live_positions_in_many(self, layer: int, reqs: list["PolicyRequest"], lo: np.ndarray, hi: np.ndarray
                               ) -> list[np.ndarray]:
        """``live_positions_in(layer, lo[i], hi[i])`` of each ``reqs[i]`` (a request may repeat), in one array read."""
    def live_positions_in_flat(self, layer: int, reqs: list["PolicyRequest"], lo: np.ndarray, hi: np.ndarray
                               ) -> tuple[np.ndarray, np.ndarray]:
        """``live_positions_in_many`` concatenated: ``(positions, counts)``, ``counts[i]`` of them ``reqs[i]``'s."""
    def live_positions_layers(self, reqs: list["PolicyRequest"], n: int) -> np.ndarray:
        """``[L, len(reqs), n]``: ``live_positions_each`` of every request in every layer, where each holds exactly
        ``n`` paged tokens in every layer, in one array read."""
    def evict_all_layers(self, positions) -> int: ...

    # --- tiers (T0 device, T1 host, T2 host compressed, T3 evicted; trtkv/cache/tiers.py) ------------
    def host_positions(self, layer: int) -> np.ndarray:
        """Positions of one layer held in the host tiers (T1/T2), ascending: attended, not on device."""
    def num_host(self, layer: int) -> int: ...
    def attended_positions(self, layer: int) -> np.ndarray:
        """Every position attention covers in one layer: device (paged + buffered) and host, ascending."""
    def attended_positions_flat(self, layer: int, reqs: list["PolicyRequest"]) -> tuple[np.ndarray, np.ndarray]:
        """``attended_positions`` of each of ``reqs`` (this one's batch) concatenated: ``(positions, counts)``."""
    def tier_of(self, layer: int, positions) -> np.ndarray:
        """Tier code per position: 0 device, 1 host, 2 host compressed, 3 evicted / never held."""
    def on_device_flat(self, layer: int, reqs: list["PolicyRequest"], positions: np.ndarray,
                       counts: np.ndarray) -> np.ndarray:
        """Whether each of ``positions`` (``counts[i]`` of them ``reqs[i]``'s) has tier 0 (device) in ``layer``."""
    def buffered_flat(self, layer: int, reqs: list["PolicyRequest"], positions: np.ndarray,
                      counts: np.ndarray) -> np.ndarray:
        """Whether each of ``positions`` (``counts[i]`` of them ``reqs[i]``'s) is in its residual buffer."""
    def place(self, layer: int | None, positions, tier: str) -> int:
        """Move positions of one layer (``None``: every layer) to ``tier``: ``"device"``, ``"host"``,
        ``"host-<format>"`` (e.g. ``host-int4``) or ``"evicted"``. Buffered positions stay where they are."""

    def place_many(self, layer: int | None, jobs: list[tuple["PolicyRequest", Any]], tier: str) -> list[int]:
        """``place`` of ``(request, positions)`` jobs of distinct requests of this one's batch, each layer's moves
        in one pass (the batch's event); returns each job's count."""
