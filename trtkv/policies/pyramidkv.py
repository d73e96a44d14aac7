"""PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", 2024, arXiv:2406.02069): SnapKV's selection with per-layer budgets that shrink with depth.

Lower layers spread their attention widely and keep more tokens; upper layers attend to a few and keep
fewer. As in the release, every layer keeps its observation window, and the rest of the capacity
``c = budget - window_size`` forms an arithmetic sequence over the layers from ``2c - c/beta`` at layer 0
to ``c/beta`` at the last (the paper's ``beta = 20``), so the mean, and the total, equal SnapKV's at the
same ``budget``. Per layer, not per head (trtkv's cache evicts per (layer, token)).

Parameters: those of SnapKV (``window_size``, ``kernel_size``, ``pooling``, ``decode_every``) plus
    beta   ratio budget / b_min (> 1)
"""
from __future__ import annotations

from dataclasses import dataclass

from trtkv.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    name = "pyramidkv"
    description = "SnapKV selection with per-layer budgets shrinking with depth (Cai et al. 2024)"
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta > 1.0:
            raise ValueError(f"beta must be > 1; got {self.beta}")

    @property
    def _capacity(self) -> tuple[float, float]:
        """(layer 0, last layer) capacity beyond the window."""
        c = self.budget - self.window_size
        return 2 * c - c / self.beta, c / self.beta

    def layer_budget(self, req, layer: int) -> int:
        L = req.num_layers
        if L == 1:
            return self.budget
        top, bottom = self._capacity
        return self.window_size + int(round(top - layer * (top - bottom) / (L - 1)))

    def max_layer_budget(self) -> int:
        return self.window_size + int(round(self._capacity[0]))
