"""Rotary position embeddings (default, linear and Llama-3 scaling), computed per position on the fly.

Matches transformers' arithmetic (fp32 inverse frequencies, cat(freqs, freqs), rotate_half) so greedy
decoding is token-identical to its reference.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from plugins.rotary.reference import rotary_ref as apply_rotary  # noqa: F401 (the model's rotation)
from trtkv.errors import TrtkvError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Returns ``(inv_freq [head_dim/2], attention_scaling)``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float)
                        / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise TrtkvError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


class Rotary:
    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device: torch.device | str = "cpu"):
        inv_freq, self.attention_scaling = inverse_frequencies(head_dim, theta, scaling)
        self.inv_freq = inv_freq.to(device)
        # cos_sin of 0..n-1 per (dtype, device): the model may move after a table was made
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, head_dim]`` cos/sin for integer positions ``[T]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def cos_sin_at(self, positions: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` of host positions, as rows of a table of ``cos_sin(0..n-1)`` (the same values: the ops are
        elementwise) grown by doubling as positions reach it: a decode step's rows by one gather."""
        top = int(positions.max()) + 1 if len(positions) else 1
        key = (dtype, self.inv_freq.device)
        table = self._tables.get(key)
        if table is None or len(table[0]) < top:
            n = max(top, 2 * len(table[0]) if table is not None else 1024)
            table = self._tables[key] = self.cos_sin(torch.arange(n, device=self.inv_freq.device), dtype)
        idx = torch.from_numpy(np.ascontiguousarray(positions, np.int64)).to(self.inv_freq.device)
        return table[0].index_select(0, idx), table[1].index_select(0, idx)
