"""Triton tile loaders for paged decode attention: one format's K/V slots dequantized in registers to the dtype
the tensor-core products take (``TD``: fp16, bf16 for bf16 pages, or fp32 for the TF32 products).

Exactness: E4M3 (FP8 and the NVFP4/ternary block scales), E2M1 and ternary codes are fp16 values, and so is
an E2M1 or ternary code times its E4M3 block scale over 256 (a 2-bit by 4-bit significand product, 2^-18 ..
10.5), so those tiles are built exactly in fp16 and the per-layer scalar scales (times ``e4m3_unit``) are
applied to the scores and the output instead (``fold_k`` / ``fold_v``). E4M3 and E2M1 codes become fp16 by
moving their bit fields into fp16's (no table, no branch), ternary crumbs through a table held in an int32
constant; the int4/int2 affine ``code * scale + zero`` and the key offsets of the ``o`` formats are the only
roundings (one fp16 rounding of the value).
"""
from __future__ import annotations

import triton
import triton.language as tl

# format codes (plugins.formats), as constexprs so the jit functions can branch on them
FP32, FP16, BF16, FP8, NVFP4, TERNARY, INT4, INT2, NVFP4O, TERNARYO = (tl.constexpr(c) for c in range(10))

# formats whose tiles are built from E4M3 fields (FP8 codes, block scales): exact in fp16, their V scale folded out
E4M3_BUILT = (FP8.value, NVFP4.value, TERNARY.value, NVFP4O.value, TERNARYO.value)
# fp16 high bytes of the ternary crumbs 00 -> 0, 01 -> +1, 10 -> 0 (-0), 11 -> -1, as a signed int32
TERN_LUT = tl.constexpr(0xBC003C00 - (1 << 32))


def fold_k(fmt_code: int) -> bool:
    """Whether the layer's K scale multiplies the scores rather than the tile (the tile is then exact)."""
    return fmt_code in (FP8.value, NVFP4.value, TERNARY.value)


def fold_v(fmt_code: int) -> bool:
    """Whether the layer's V scale multiplies the output rather than the tile."""
    return fmt_code in E4M3_BUILT


def e4m3_unit(fmt_code: int) -> float:
    """What this format's tiles leave out and its scalar scales (scores, the offset keys' K scale, output) put
    back: 256 where E4M3 fields (FP8 codes, block scales) build the tiles (``_e4m3`` gives value / 256; a
    power of two, so every product and sum is the same up to that exact factor), else 1."""
    return 256.0 if fmt_code in E4M3_BUILT else 1.0


@triton.jit
def _half(bits):
    """int32 fp16 bit patterns (0..0xFFFF) to fp16."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3(b):
    """E4M3fn bits (int32 0..255) to fp16 value / 256, exactly: the sign and the 7 exponent-mantissa bits moved
    into fp16's fields are the value times 2^-8 (E4M3's bias 7 under fp16's 15; its subnormals land on fp16
    subnormals of the same significand); 0x7F/0xFF are NaN (no select: it costs registers where ptxas has none to
    spare). The 256 is the caller's (``e4m3_unit``)."""
    x = b & 0x7F
    # (x + 1) carries into bit 7 for 0x7F alone: that bit set at fp16's exponent MSB makes the exponent 31 (NaN)
    return _half(((b & 0x80) << 8) | (x << 7) | (((x + 1) & 0x80) << 7))


@triton.jit
def _e2m1(nib):
    """E2M1 nibble (bit 3 sign, 2 exponent bits of bias 1, 1 mantissa bit) to fp16, exactly: the fields shifted
    into fp16's are the value times 2^-14 (the subnormal 0.5 lands on fp16's subnormal 2^-15), times 2^14."""
    return _half(((nib & 8) << 12) | ((nib & 7) << 9)) * 16384.0


@triton.jit
def _tern(c):
    """2-bit sign-magnitude crumb (01 -> +1, 11 -> -1, 00 and 10 -> 0) to fp16 by table."""
    return _half(((tl.full(c.shape, TERN_LUT, tl.int32) >> (c * 8)) & 0xFF) << 8)


@triton.jit
def _codes(ptr, row, live, offs_d, m2, BITS: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
           PACKED: tl.constexpr):
    """``BITS``-bit codes ``[N, DP]`` int32 of the rows ``row``, element ``d`` in bits ``(d % per) * BITS`` of
    byte ``d // per``. Packed: each row's bytes are one contiguous (vectorizable) load, split into fields in
    registers and interleaved back (join + reshape); else one byte load per element."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if PACKED:
        offs_b = tl.arange(0, D // PER)
        x = tl.load(ptr + row[:, None] * (D // PER) + offs_b[None, :], mask=live[:, None], other=0).to(tl.int32)
        if BITS == 4:
            c = tl.join(x & 15, (x >> 4) & 15)
        else:
            # join stacks on a new last axis: [(c0, c2), (c1, c3)] pairs flatten to c0 c1 c2 c3
            c = tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, (x >> 6) & 3))
        return tl.reshape(c, (N, D))
    else:
        d = offs_d[None, :]
        x = tl.load(ptr + row[:, None] * (D // PER) + d // PER, mask=m2, other=0).to(tl.int32)
        return (x >> ((d % PER) * BITS)) & MASK


@triton.jit
def _per16(ptr, row, live, offs_d, m2, D: tl.constexpr, N: tl.constexpr, PACKED: tl.constexpr,
           E4M3: tl.constexpr = False):
    """A per-16-channel field ``[rows, D // 16]`` (value scales, zero points) expanded to ``[N, DP]``, E4M3 bytes
    decoded to fp16 (``E4M3``): packed, one load of ``D // 16`` values a row, decoded, then broadcast over their 16
    channels; else one load per element."""
    if PACKED:
        offs_s = tl.arange(0, D // 16)
        x = tl.load(ptr + row[:, None] * (D // 16) + offs_s[None, :], mask=live[:, None], other=0)
        if E4M3:
            x = _e4m3(x.to(tl.int32))
        return tl.reshape(tl.broadcast_to(x[:, :, None], (N, D // 16, 16)), (N, D))
    else:
        x = tl.load(ptr + row[:, None] * (D // 16) + offs_d[None, :] // 16, mask=m2, other=0)
        return _e4m3(x.to(tl.int32)) if E4M3 else x


@triton.jit
def load_kv(f0, f1, f2, f3, g0, g1, kgrp_ptr, page, slot, live, h, offs_d, dmask, scale_k,
            FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, B: tl.constexpr, N: tl.constexpr,
            PACKED: tl.constexpr, TD: tl.constexpr):
    """K, V tiles ``[N, DP]`` in ``TD`` of head ``h`` for the slot lanes ``(page, slot)``, dead lanes 0. The
    layer's scalar scales are left out where ``fold_k`` / ``fold_v`` say so (the caller applies them)."""
    row = (page.to(tl.int64) * B + slot) * H + h  # [N] slot-row index into [pages, B, H, ...]
    m2 = live[:, None] & dmask[None, :]
    d = offs_d[None, :]
    if FMT <= BF16:
        k = tl.load(f0 + row[:, None] * D + d, mask=m2, other=0.0).to(TD)
        v = tl.load(f1 + row[:, None] * D + d, mask=m2, other=0.0).to(TD)
    elif FMT == FP8:
        k = _e4m3(tl.load(f0 + row[:, None] * D + d, mask=m2, other=0).to(tl.int32)).to(TD)
        v = _e4m3(tl.load(f1 + row[:, None] * D + d, mask=m2, other=0).to(tl.int32)).to(TD)
    else:
        BITS: tl.constexpr = 4 if (FMT == NVFP4 or FMT == INT4 or FMT == NVFP4O) else 2
        kc = _codes(f0, row, live, offs_d, m2, BITS, D, N, PACKED)
        vc = _codes(f1, row, live, offs_d, m2, BITS, D, N, PACKED)
        gid = tl.load(kgrp_ptr + page.to(tl.int64) * B + slot, mask=live, other=0)
        grow = (tl.maximum(gid, 0).to(tl.int64) * H + h)[:, None] * D + d  # group field [gid, h, d]
        if FMT == INT4 or FMT == INT2:
            k = kc.to(TD) * tl.load(g0 + grow, mask=m2, other=0.0).to(TD) \
                + tl.load(g1 + grow, mask=m2, other=0.0).to(TD)
            v = vc.to(TD) * _per16(f2, row, live, offs_d, m2, D, N, PACKED).to(TD) \
                + _per16(f3, row, live, offs_d, m2, D, N, PACKED).to(TD)
        else:
            if FMT == NVFP4 or FMT == NVFP4O:
                ke = _e2m1(kc)
                ve = _e2m1(vc)
            else:
                ke = _tern(kc)
                ve = _tern(vc)
            k = ke * _e4m3(tl.load(g0 + grow, mask=m2, other=0).to(tl.int32))  # exact in fp16
            v = (ve * _per16(f2, row, live, offs_d, m2, D, N, PACKED, True)).to(TD)
            if FMT == NVFP4O or FMT == TERNARYO:
                k = (k.to(tl.float32) * scale_k + tl.load(g1 + grow, mask=m2, other=0.0).to(tl.float32)).to(TD)
            else:
                k = k.to(TD)
    # a live slot may hold any finite code; dead lanes are already 0, keep NaN-free for the p @ V product
    return k, tl.where(m2, v, 0.0)
