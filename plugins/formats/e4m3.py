"""Bit-exact FP8 E4M3 ("fn": bias 7, no infinities, 0x7F/0xFF are NaN, max 448) on uint8 bit patterns.

Written out by hand rather than via ``torch.float8_e4m3fn`` because block scales must round *up*
(so elements never clip), which no cast offers, and because the Triton kernels replicate exactly
these steps. Conventions every encoder here shares (kernels must match them):

* all math in fp32; |x| above 448 (and +-inf) saturates to 448; NaN encodes as 0, so NaN is never
  produced;
* the sign bit is the IEEE sign bit of the input, so a negative value whose magnitude rounds to 0
  encodes as 0x80 (this matches the hardware cvt / ``torch`` cast after clamping).
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_MAX_BITS = 0x7E
_MIN_EXP = -6  # exponent of the smallest normal; subnormals share its quantum 2**-9


def e4m3_encode(x: torch.Tensor, round_up: bool = False) -> torch.Tensor:
    """E4M3 bits of ``x``: round-to-nearest-even, or ceiling of the magnitude when ``round_up``."""
    x = x.float()
    neg = torch.signbit(x)
    a = torch.nan_to_num(x.abs(), nan=0.0, posinf=E4M3_MAX).clamp(max=E4M3_MAX)
    # a = f * 2**e with f in [0.5, 1): the binade exponent is e - 1, exactly (no log2 rounding)
    e = (torch.frexp(a).exponent - 1).clamp(min=_MIN_EXP)
    m = a * torch.exp2((3 - e).float())  # exact: the value in units of the binade's quantum
    m = torch.ceil(m) if round_up else torch.round(m)  # torch.round is half-to-even
    carry = m == 16  # rounded into the next binade (never past 448: a <= 448 = 14 * 32)
    e = e + carry.int()
    m = torch.where(carry, torch.full_like(m, 8.0), m)
    normal = m >= 8  # m < 8 only for subnormals (e == -6) and zero
    exp_field = torch.where(normal, e + 7, torch.zeros_like(e))
    man = torch.where(normal, m - 8, m).int()
    bits = (exp_field << 3) | man | (neg.int() << 7)
    return bits.to(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of E4M3 bit patterns (NaN for 0x7F/0xFF, which no encoder here writes)."""
    b = bits.to(torch.int32)
    exp = (b >> 3) & 0xF
    man = (b & 7).float()
    mag = torch.where(exp > 0, (man + 8) * torch.exp2((exp - 10).float()), man * 2.0**-9)
    mag = torch.where((b & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((b & 0x80) != 0, -mag, mag)


def e4m3_saturates(x: torch.Tensor) -> torch.Tensor:
    """Bool mask of where encoding ``x`` clips at 448 (scales: the group then loses its no-clip bound)."""
    return x.float().abs() > E4M3_MAX
