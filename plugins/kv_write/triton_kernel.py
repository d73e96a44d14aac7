"""Triton kv_write: quantize one flush group, pack it and scatter it into its slots (spec §5.4).

Bit-exact with the torch encoders in ``plugins.formats``: every step is the same fp32 operation in the
same order (IEEE ``div_rn`` divisions, E4M3 scales rounded up by integer arithmetic on the fp32 bit
pattern, RNE element grids, the fp32 sign bit as the element sign). Write-through formats run one
program per (token, head); block-scaled formats one program per (head, channel block) holding all
``n <= 16`` tokens, because a key scale is the amax over the group's tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.formats import format_by_code

_GROUPED = {
    4: (4, False, 6.0, False, False),  # nvfp4
    5: (2, False, 1.0, True, False),  # ternary
    6: (4, True, 0.0, False, False),  # int4
    7: (2, True, 0.0, False, False),  # int2
    8: (4, False, 6.0, False, True),  # nvfp4o
    9: (2, False, 1.0, True, True),  # ternaryo
}
"""code -> (bits per element, asymmetric int, qmax, ternary grid, key offset)."""


@triton.jit
def _e4m3_round_up(a):
    """Smallest E4M3 value >= ``a`` (a >= 0, NaN -> 0, saturating at 448): ``(bits int32, value fp32)``."""
    a = tl.where(a == a, a, 0.0)
    a = tl.minimum(a, 448.0)
    # normal binades: round the fp32 mantissa up to 3 bits (a carry rolls into the exponent)
    up = (a.to(tl.int32, bitcast=True) + 0xFFFFF) & ~0xFFFFF
    nbits = ((((up >> 23) & 0xFF) - 120) << 3) | ((up >> 20) & 7)
    # subnormals share the quantum 2^-9; ceil(a * 512) == 8 is the smallest normal, bits 0x08 too
    m = tl.ceil(a * 512.0)
    normal = a >= 0.015625
    bits = tl.where(normal, nbits, m.to(tl.int32))
    return bits, tl.where(normal, up.to(tl.float32, bitcast=True), m * 0.001953125)


@triton.jit
def _encode_elem(r, TERN: tl.constexpr):
    """Element codes of ``r = x / s_eff``: ternary round-half-even clamp, or E2M1 RNE with the sign bit."""
    if TERN:
        return tl.where(r > 0.5, 1, tl.where(r < -0.5, 3, 0))
    a = tl.where(r == r, tl.minimum(tl.abs(r), 6.0), 0.0)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return code | (((r.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _pack(codes, NP: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
    """``[NP, W]`` codes -> ``[NP, W*BITS/8]`` bytes, element j of a byte at bit ``BITS*j``."""
    PER: tl.constexpr = 8 // BITS
    c = tl.reshape(codes, (NP, W // PER, PER))
    return tl.sum(c << (tl.arange(0, PER) * BITS)[None, None, :], axis=2).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """bf16 bits (int32) of fp32 ``x``, RNE and canonical NaN like torch; done by hand because the
    Triton interpreter truncates on ``.to(tl.bfloat16)``."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x == x, r, 0x7FC0)


@triton.jit
def _write_float_kernel(k_ptr, v_ptr, fk, fv, pages_ptr, slots_ptr,
                        H: tl.constexpr, D: tl.constexpr, B: tl.constexpr, DP: tl.constexpr, BF16: tl.constexpr):
    """fp32/fp16 pools take a cast (RNE); bf16 pools arrive as int16 views and take ``_bf16_bits``."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    row = (tl.load(pages_ptr + i).to(tl.int64) * B + tl.load(slots_ptr + i)) * H + h
    src = (i * H + h) * D + offs_d
    k = tl.load(k_ptr + src, mask=dmask)
    v = tl.load(v_ptr + src, mask=dmask)
    if BF16:
        k = _bf16_bits(k.to(tl.float32)).to(tl.int16)
        v = _bf16_bits(v.to(tl.float32)).to(tl.int16)
    tl.store(fk + row * D + offs_d, k.to(fk.dtype.element_ty), mask=dmask)
    tl.store(fv + row * D + offs_d, v.to(fv.dtype.element_ty), mask=dmask)


@triton.jit
def _rne(y):
    """Round half to even for |y| < 2^22 (larger |y| only feed clamps); the 1.5 * 2^23 trick."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _e4m3_rne(r):
    """E4M3 bits (int32) of ``r``: RNE, saturating at 448, NaN -> 0, sign = the fp32 sign bit."""
    a = tl.where(r == r, tl.minimum(tl.abs(r), 448.0), 0.0)
    ab = a.to(tl.int32, bitcast=True)
    up = (ab + 0x7FFFF + ((ab >> 20) & 1)) & ~0xFFFFF
    nbits = ((((up >> 23) & 0xFF) - 120) << 3) | ((up >> 20) & 7)
    bits = tl.where(a >= 0.015625, nbits, _rne(a * 512.0).to(tl.int32))
    return bits | (((r.to(tl.int32, bitcast=True) >> 31) & 1) << 7)


@triton.jit
def _int_params(lo, hi, LEVELS: tl.constexpr):
    """fp16 (scale, zero) of a [lo, hi] range, rounded before the codes are computed against them."""
    scale = tl.minimum(tl.math.div_rn(hi - lo, LEVELS * 1.0), 65504.0).to(tl.float16)
    zero = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16)
    return scale, zero


@triton.jit
def _int_codes(x, scale, zero, LEVELS: tl.constexpr):
    s = scale.to(tl.float32)
    q = tl.where(s > 0, _rne(tl.math.div_rn(x - zero.to(tl.float32), tl.where(s > 0, s, 1.0))), 0.0)
    return tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0).to(tl.int32)


@triton.jit
def _write_fp8_kernel(k_ptr, v_ptr, fk, fv, pages_ptr, slots_ptr, gk, gv,
                      H: tl.constexpr, D: tl.constexpr, B: tl.constexpr, DP: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    row = (tl.load(pages_ptr + i).to(tl.int64) * B + tl.load(slots_ptr + i)) * H + h
    src = (i * H + h) * D + offs_d
    k = tl.math.div_rn(tl.load(k_ptr + src, mask=dmask, other=0.0).to(tl.float32), gk)
    v = tl.math.div_rn(tl.load(v_ptr + src, mask=dmask, other=0.0).to(tl.float32), gv)
    tl.store(fk + row * D + offs_d, _e4m3_rne(k).to(tl.uint8), mask=dmask)
    tl.store(fv + row * D + offs_d, _e4m3_rne(v).to(tl.uint8), mask=dmask)


@triton.jit
def _write_group_kernel(
    k_ptr, v_ptr, fk, fv, fvs, fvz, g0, g1, kgrp_ptr, pages_ptr, slots_ptr, n, gids_ptr, gk, gv,
    H: tl.constexpr, D: tl.constexpr, B: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
    BITS: tl.constexpr, INT: tl.constexpr, QMAX: tl.constexpr, TERN: tl.constexpr, KEY_OFFSET: tl.constexpr,
):
    """One flush group (``program_id(2)``: group ``j`` of ``n`` tokens, arena entry ``gids[j]``), one head,
    ``BLOCK_D`` channels. Block-scaled (E4M3 scales, ``g0 = k_scale``, ``g1 = k_offset``) or, with ``INT``,
    asymmetric integers (``g0, g1 = k_scale, k_zero``; ``fvz``)."""
    h = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    j = tl.program_id(2).to(tl.int64)
    gid = tl.load(gids_ptr + j).to(tl.int64)
    k_ptr += j * n * H * D
    v_ptr += j * n * H * D
    pages_ptr += j * n
    slots_ptr += j * n
    NG: tl.constexpr = BLOCK_D // 16
    WB: tl.constexpr = BLOCK_D * BITS // 8
    LEVELS: tl.constexpr = (1 << BITS) - 1
    offs_t = tl.arange(0, NP)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    tmask = offs_t < n
    m2 = tmask[:, None]
    page = tl.load(pages_ptr + offs_t, mask=tmask, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + offs_t, mask=tmask, other=0)
    row = (page * B + slot) * H + h  # [NP]
    src = (offs_t * H + h)[:, None] * D + offs_d[None, :]
    grow = (gid * H + h) * D + offs_d  # group arena row [gid, h, d-block]
    offs_b = d0 * BITS // 8 + tl.arange(0, WB)
    offs_g = d0 // 16 + tl.arange(0, NG)

    # keys: one scale per channel over the group's tokens (scale, offset/zero to the arena)
    x = tl.load(k_ptr + src, mask=m2, other=0.0).to(tl.float32)
    mx = tl.max(tl.where(m2, x, float("-inf")), axis=0)
    mn = tl.min(tl.where(m2, x, float("inf")), axis=0)
    if INT:
        ks, kz = _int_params(mn, mx, LEVELS)
        tl.store(g0 + grow, ks)
        tl.store(g1 + grow, kz)
        kc = _int_codes(x, ks[None, :], kz[None, :], LEVELS)
    else:
        if KEY_OFFSET:
            off = ((mx + mn) * 0.5).to(tl.float16)
            tl.store(g1 + grow, off)
            x = x - off.to(tl.float32)[None, :]
        amax = tl.max(tl.where(m2, tl.abs(x), 0.0), axis=0)
        kbits, ksv = _e4m3_round_up(tl.math.div_rn(amax, QMAX * gk))
        tl.store(g0 + grow, kbits.to(tl.uint8))
        sk = (ksv * gk)[None, :]
        kc = _encode_elem(tl.where(sk > 0, tl.math.div_rn(x, tl.where(sk > 0, sk, 1.0)), 0.0), TERN)
    tl.store(fk + row[:, None] * (D * BITS // 8) + offs_b[None, :], _pack(kc, NP, BLOCK_D, BITS), mask=m2)

    # values: one scale per token per 16 channels (stored in the slot)
    y = tl.reshape(tl.load(v_ptr + src, mask=m2, other=0.0).to(tl.float32), (NP, NG, 16))
    vrow = row[:, None] * (D // 16) + offs_g[None, :]
    if INT:
        vs, vz = _int_params(tl.min(y, axis=2), tl.max(y, axis=2), LEVELS)
        tl.store(fvs + vrow, vs, mask=m2)
        tl.store(fvz + vrow, vz, mask=m2)
        vc = _int_codes(y, vs[:, :, None], vz[:, :, None], LEVELS)
    else:
        vbits, vsv = _e4m3_round_up(tl.math.div_rn(tl.max(tl.abs(y), axis=2), QMAX * gv))
        tl.store(fvs + vrow, vbits.to(tl.uint8), mask=m2)
        sv = (vsv * gv)[:, :, None]
        vc = _encode_elem(tl.where(sv > 0, tl.math.div_rn(y, tl.where(sv > 0, sv, 1.0)), 0.0), TERN)
    vc = _pack(tl.reshape(vc, (NP, BLOCK_D)), NP, BLOCK_D, BITS)
    tl.store(fv + row[:, None] * (D * BITS // 8) + offs_b[None, :], vc, mask=m2)

    if (h == 0) & (d0 == 0):
        tl.store(kgrp_ptr + page * B + slot, tl.zeros([NP], tl.int32) + gid.to(tl.int32), mask=tmask)


def _block_d(D: int) -> int:
    """Channels per program: a power-of-two multiple of 16 dividing D, at most 64."""
    g = D // 16
    return 16 * min(4, g & -g)


def kv_write_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_fields: list[torch.Tensor],
    group_fields: list[torch.Tensor],
    k_group: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
    gid: int,
    fmt_code: int,
    scale_k: float,
    scale_v: float,
) -> None:
    """Same contract as ``kv_write_ref``; pools and arena must be contiguous."""
    if k.shape[0]:  # (the arena entry as a tensor only where a grouped format needs one)
        gids = torch.full((1,), int(gid), dtype=torch.int64, device=k.device) if fmt_code in _GROUPED else None
        _launch(k[None], v[None], slot_fields, group_fields, k_group, pages[None], slots[None], gids, fmt_code,
                scale_k, scale_v)


def kv_write_groups_triton(k, v, slot_fields, group_fields, k_group, pages, slots, gids, fmt_code, scale_k,
                           scale_v) -> None:
    """Same contract as ``kv_write_groups_ref`` (``k, v [G, n, H, D]``, ``pages, slots [G, n]``, ``gids [G]``):
    one launch for every group."""
    if k.shape[0] and k.shape[1]:
        _launch(k, v, slot_fields, group_fields, k_group, pages, slots, gids.to(k.device, torch.int64), fmt_code,
                scale_k, scale_v)


def _launch(k, v, slot_fields, group_fields, k_group, pages, slots, gids, fmt_code, scale_k, scale_v) -> None:
    """``G`` groups of ``n`` tokens: write-through formats as ``G * n`` tokens, grouped ones a program axis."""
    G, n, H, D = k.shape
    B = slot_fields[0].shape[1]
    assert all(t.is_contiguous() for t in [*slot_fields, *group_fields, k_group])
    k, v = k.contiguous(), v.contiguous()
    pages, slots = pages.to(torch.int32).contiguous(), slots.to(torch.int32).contiguous()
    if fmt_code <= 3:  # one program per (token, head): the groups are G * n tokens
        k, v, n = k.view(G * n, H, D), v.view(G * n, H, D), G * n
    if fmt_code <= 2:
        bf16 = fmt_code == 2
        fk, fv = (t.view(torch.int16) if bf16 else t for t in slot_fields)
        _write_float_kernel[(n, H)](k, v, fk, fv, pages, slots, H=H, D=D, B=B, DP=triton.next_power_of_2(D), BF16=bf16)
    elif fmt_code == 3:
        _write_fp8_kernel[(n, H)](k, v, *slot_fields, pages, slots, float(scale_k), float(scale_v),
                                  H=H, D=D, B=B, DP=triton.next_power_of_2(D))
    elif fmt_code in _GROUPED:
        bits, is_int, qmax, tern, key_offset = _GROUPED[fmt_code]
        assert n <= format_by_code(fmt_code).group_size and D % 16 == 0
        f = list(slot_fields) + [slot_fields[2]] * (4 - len(slot_fields))
        g = list(group_fields) + [group_fields[0]] * (2 - len(group_fields))
        bd = _block_d(D)
        _write_group_kernel[(H, D // bd, G)](
            k, v, *f, *g, k_group, pages, slots, n, gids, float(scale_k), float(scale_v),
            H=H, D=D, B=B, NP=max(2, triton.next_power_of_2(n)), BLOCK_D=bd, BITS=bits, INT=is_int, QMAX=qmax,
            TERN=tern, KEY_OFFSET=key_offset,
        )
    else:
        raise ValueError(f"kv_write_triton: no kernel for format code {fmt_code}")
