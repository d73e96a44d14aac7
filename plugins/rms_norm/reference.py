"""Torch reference of RMS normalization, the model's definition (transformers' LlamaRMSNorm, in fp32):
``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension. ``trtkv/models/decoder.py`` calls it through
``plugins.ops.rms_norm``, which runs the compiled CPU kernel on plain fp32 CPU tensors: one pass over a row
instead of torch's ten dispatched ops (``_fused_rms_norm`` is composite on CPU), bit-identical (the sum of
squares is still torch's)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., C]``, ``weight [C]`` -> normalized ``x`` in its dtype (computed in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
