"""What a policy sees of one request: positions, counts, and the actions it may ask the cache for."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trtkv.cache.manager import KVCacheManager, SeqKV


class RequestContext:
    def __init__(self, req_id: int, prompt_len: int, cache: KVCacheManager, seq: SeqKV, num_layers: int):
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.step = -1  # decode index of the token being processed (-1 during prefill)
        self.cache = cache
        self.seq = seq
        self.num_layers = num_layers
        self.state: dict[str, Any] = {}  # the policy's per-request state

    @property
    def position(self) -> int:
        """Absolute position of the token processed in the current step."""
        return self.prompt_len + max(self.step, 0)

    def live_positions(self, layer: int) -> np.ndarray:
        """Paged positions of one layer, ascending (the residual buffer is not included)."""
        return self.cache.live_positions(self.seq, layer)

    def buffered_positions(self, layer: int) -> list[int]:
        return list(self.seq.buf_pos[layer]) if self.seq.buf_pos else []

    def num_live(self, layer: int) -> int:
        return self.seq.layers[layer].live + self.seq.buffered(layer)

    def evict(self, layer: int, positions) -> int:
        return self.cache.evict(self.seq, layer, positions)

    def evict_all_layers(self, positions) -> int:
        return sum(self.cache.evict(self.seq, layer, positions) for layer in range(self.num_layers))

    def keys(self, layer: int, positions) -> torch.Tensor:
        """Dequantized post-RoPE keys ``[m, H, D]`` fp32 of paged positions (read-only)."""
        return self.cache.gather_kv(self.seq, layer, positions)[0]

    def kv(self, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.gather_kv(self.seq, layer, positions)
