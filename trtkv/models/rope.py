"""Rotary position embeddings (default, linear and Llama-3 scaling), computed per position on the fly.

Matches transformers' arithmetic (fp32 inverse frequencies, cat(freqs, freqs), rotate_half) so greedy
decoding is token-identical to its reference.
"""
from __future__ import annotations

import math

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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, head_dim]`` cos/sin for integer positions ``[T]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
