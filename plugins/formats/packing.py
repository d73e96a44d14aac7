"""Sub-byte packing along the last (channel) axis, and the value-group view.

Little-endian within a byte (element j of a byte at bit ``bits*j``) so a kernel unpacks with a
shift by ``bits * (d % per_byte)`` and one mask, for any leading dims.
"""
from __future__ import annotations

import torch

VALUE_GROUP = 16  # channels per value scale (one token, one head)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` codes in ``[0, 2**bits)`` -> ``[..., D*bits/8]`` uint8."""
    per = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., B]`` uint8 -> ``[..., B*8/bits]`` int32 codes."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def value_groups(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D/16, 16]``: the channels that share one value scale."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // VALUE_GROUP, VALUE_GROUP)


def per_channel(s: torch.Tensor) -> torch.Tensor:
    """``[..., D/16]`` value-group parameters broadcast to ``[..., D]``."""
    return s.repeat_interleave(VALUE_GROUP, dim=-1)
