"""Triton paged decode attention over one format's pages (spec §5.6); oracle: ``reference.py``.

One program handles one (sequence, KV head, KV split) and all G query heads that share the KV head, so
each page is read and dequantized once per KV head. The format is a constexpr: one specialization per
format, no per-element branching. Each iteration covers ``PAGES`` pages (``PAGES * B`` slots) so the tiles
stay useful at ``B = 8``; page ids, validity words and group ids are gathered per slot lane (each page's
int32 word is read once per page from memory, the duplicate lanes hit cache). Dead slots are never loaded
(masked loads) and get ``-inf`` logits, so stale codes in evicted slots cannot leak into the output.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins.paged_attention.reference import merge_splits

# format codes (plugins.formats), as constexprs so the jit functions can branch on them
FP32, FP16, BF16, FP8, NVFP4, TERNARY, INT4, INT2, NVFP4O, TERNARYO = (tl.constexpr(c) for c in range(10))


@triton.jit
def _e4m3(b):
    """E4M3fn bits (int32 0..255) to fp32 by building the fp32 bit pattern; 0x7F/0xFF are NaN."""
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = b & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    sub = tl.where(sign == 1, -sub, sub)
    val = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), val)


@triton.jit
def _e2m1(nib):
    """E2M1 nibble (bit 3 sign, bits 2..0 index into [0, .5, 1, 1.5, 2, 3, 4, 6]) to fp32."""
    e = (nib >> 1) & 3
    m = nib & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((nib & 8) != 0, -mag, mag)


@triton.jit
def _tern(c):
    """2-bit sign-magnitude crumb: 01 -> +1, 11 -> -1, 00 and 10 (-0) -> 0."""
    return tl.where(c == 1, 1.0, tl.where(c == 3, -1.0, 0.0))


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
def _per16(ptr, row, live, offs_d, m2, D: tl.constexpr, N: tl.constexpr, PACKED: tl.constexpr):
    """A per-16-channel field ``[rows, D // 16]`` (value scales, zero points) expanded to ``[N, DP]``: packed,
    one load of ``D // 16`` values a row broadcast over their 16 channels; else one load per element."""
    if PACKED:
        offs_s = tl.arange(0, D // 16)
        x = tl.load(ptr + row[:, None] * (D // 16) + offs_s[None, :], mask=live[:, None], other=0)
        return tl.reshape(tl.broadcast_to(x[:, :, None], (N, D // 16, 16)), (N, D))
    else:
        return tl.load(ptr + row[:, None] * (D // 16) + offs_d[None, :] // 16, mask=m2, other=0)


@triton.jit
def _load_kv(f0, f1, f2, f3, g0, g1, kgrp_ptr, page, slot, live, h, offs_d, dmask, scale_k, scale_v,
             FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, B: tl.constexpr, N: tl.constexpr,
             PACKED: tl.constexpr):
    """Dequantized K, V tiles ``[N, DP]`` fp32 of head ``h`` for the slot lanes ``(page, slot)``."""
    row = (page.to(tl.int64) * B + slot) * H + h  # [N] slot-row index into [pages, B, H, ...]
    m2 = live[:, None] & dmask[None, :]
    d = offs_d[None, :]
    if FMT <= BF16:
        k = tl.load(f0 + row[:, None] * D + d, mask=m2, other=0.0).to(tl.float32)
        v = tl.load(f1 + row[:, None] * D + d, mask=m2, other=0.0).to(tl.float32)
    elif FMT == FP8:
        k = _e4m3(tl.load(f0 + row[:, None] * D + d, mask=m2, other=0).to(tl.int32)) * scale_k
        v = _e4m3(tl.load(f1 + row[:, None] * D + d, mask=m2, other=0).to(tl.int32)) * scale_v
    else:
        BITS: tl.constexpr = 4 if (FMT == NVFP4 or FMT == INT4 or FMT == NVFP4O) else 2
        kc = _codes(f0, row, live, offs_d, m2, BITS, D, N, PACKED)
        vc = _codes(f1, row, live, offs_d, m2, BITS, D, N, PACKED)
        gid = tl.load(kgrp_ptr + page.to(tl.int64) * B + slot, mask=live, other=0)
        grow = (tl.maximum(gid, 0).to(tl.int64) * H + h)[:, None] * D + d  # group field [gid, h, d]
        if FMT == INT4 or FMT == INT2:
            k = kc.to(tl.float32) * tl.load(g0 + grow, mask=m2, other=0.0).to(tl.float32) \
                + tl.load(g1 + grow, mask=m2, other=0.0).to(tl.float32)
            v = vc.to(tl.float32) * _per16(f2, row, live, offs_d, m2, D, N, PACKED).to(tl.float32) \
                + _per16(f3, row, live, offs_d, m2, D, N, PACKED).to(tl.float32)
        else:
            if FMT == NVFP4 or FMT == NVFP4O:
                ke = _e2m1(kc)
                ve = _e2m1(vc)
            else:
                ke = _tern(kc)
                ve = _tern(vc)
            k = ke * _e4m3(tl.load(g0 + grow, mask=m2, other=0).to(tl.int32)) * scale_k
            v = ve * _e4m3(_per16(f2, row, live, offs_d, m2, D, N, PACKED).to(tl.int32)) * scale_v
            if FMT == NVFP4O or FMT == TERNARYO:
                k = k + tl.load(g1 + grow, mask=m2, other=0.0).to(tl.float32)
    # a live slot may hold any finite code; dead lanes are already 0, keep NaN-free for the p @ V product
    return k, tl.where(m2, v, 0.0)


@triton.jit
def _paged_attn_kernel(
    q_ptr, f0, f1, f2, f3, g0, g1, kgrp_ptr, bits_ptr, bt_ptr, out_ptr, lse_ptr, logits_ptr,
    sm_scale, scale_k, scale_v, P, pages_per_split,
    FMT: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
    GP: tl.constexpr, DP: tl.constexpr, PAGES: tl.constexpr, NUM_SPLITS: tl.constexpr,
    RETURN_LOGITS: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr,
):
    bi = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    offs_n = tl.arange(0, PAGES * B)
    gmask = offs_g < G
    dmask = offs_d < D
    qh = bi * H * G + h * G + offs_g  # query-head rows [GP] of q [b, H*G, D]
    q = tl.load(q_ptr + qh[:, None] * D + offs_d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(tl.float32)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    p_lo = sp * pages_per_split
    p_hi = tl.minimum(p_lo + pages_per_split, P)
    for p0 in range(p_lo, p_hi, PAGES):
        pidx = p0 + offs_n // B
        slot = offs_n % B
        in_tab = pidx < p_hi
        page = tl.load(bt_ptr + bi * P + pidx, mask=in_tab, other=-1)
        word = tl.load(bits_ptr + tl.maximum(page, 0), mask=page >= 0, other=0)
        live = (page >= 0) & (((word >> slot) & 1) != 0)
        k, v = _load_kv(f0, f1, f2, f3, g0, g1, kgrp_ptr, tl.maximum(page, 0), slot, live, h, offs_d, dmask,
                        scale_k, scale_v, FMT, H, D, B, PAGES * B, PACKED)
        # the G query heads of this KV head against the tile: a [GP, DP] x [DP, N] product on the tensor
        # cores; tf32x3 (three TF32 products: hi*hi + hi*lo + lo*hi) keeps fp32 accuracy
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [GP, N]
        s = tl.where(live[None, :], s, float("-inf"))
        if RETURN_LOGITS:
            lmask = gmask[:, None] & in_tab[None, :]
            tl.store(logits_ptr + qh[:, None] * (P * B) + (pidx * B + slot)[None, :], s, mask=lmask)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all dead so far: keep exp() finite
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    orow = qh * NUM_SPLITS + sp  # out [b, Hq, S, D], lse [b, Hq, S]
    tl.store(out_ptr + orow[:, None] * D + offs_d[None, :], out, mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + orow, lse, mask=gmask)


def packed_rows(D: int) -> bool:
    """Whether a head's code bytes and per-16 fields load as whole rows (power-of-two ``D >= 32``: every
    sub-row ``arange`` is a power of two) rather than one load per element. ``D = 16`` loads per element: its
    packed rows gave wrong values for every 4-/2-bit format on an H200 (Triton 3.6, 2026-11-27; right in the
    interpreter and at D = 32/64/128 on the same GPU; not root-caused)."""
    return D >= 32 and D & (D - 1) == 0


PRECISIONS = ("tf32x3", "tf32")


def default_precision() -> str:
    """``tf32x3`` (default): three TF32 products per ``tl.dot`` (hi*hi + hi*lo + lo*hi), fp32-accurate: the
    reference's 3e-5 holds. ``TRTKV_TRITON_PRECISION=tf32``: one product, P and non-exact dequantized
    values rounded to TF32's 10-bit mantissa (as FlashAttention rounds P to fp16), measured faster on an
    H200 (docs/benchmarks.md, GPU)."""
    p = os.environ.get("TRTKV_TRITON_PRECISION", "tf32x3")
    if p not in PRECISIONS:
        from trtkv.errors import TrtkvError

        raise TrtkvError(f"TRTKV_TRITON_PRECISION={p!r} is not one of {', '.join(PRECISIONS)}; unset it or pick one")
    return p


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is tiled: slots per loop step (``pages * B``), warps and pipeline stages per program,
    and KV splits (``None``: the heuristic in ``_num_splits``)."""

    pages: int
    warps: int
    stages: int
    splits: int | None = None
    precision: str = PRECISIONS[0]


TILE_SLOTS = 32  # slots per loop step (>= 16: the K extent of the P @ V product on the tensor cores)


@functools.lru_cache(maxsize=None)  # per call on the decode path: read the environment once
def launch_config(B: int, G: int, D: int, P: int, fmt_code: int, cc: int = 90) -> LaunchConfig:
    """The default tiling. The scores and P@V are ``tl.dot`` products, so a step's registers are the K and V
    tiles ``[PAGES*B, DP]`` (fp32 after dequantization) rather than the ``[GP, PAGES*B, DP]`` broadcast
    product the first kernel reduced (255 registers and spills at one 8-slot page, D=128). ``TILE_SLOTS``
    slots a step; 4 warps, one stage at D=128 (fastest of the tilings timed on an H200, docs/benchmarks.md).
    Warps and stages elsewhere, per target ``cc`` (``target_cc``), are what ptxas allocates without spills
    (tests/kernels/test_triton_aot.py compiles every default specialization for sm_80, sm_90 and sm_100):
    on sm_90 fp32 pages at D=128 spill 8 bytes on 4 warps, D=64 on one stage, D=16 on 8 warps; sm_80 spills
    8-16 bytes at D=64 on 8 warps (128 registers), sm_100 at D=128 on one stage and int4 at D=64 on 8 warps.
    The sm_80/sm_100 choices are spill-free, not timed (no such GPU was lent). ``P`` does not cap the tile:
    lanes past the block table are masked, and the tile must stay >= 16 slots."""
    DP = triton.next_power_of_2(D)
    if DP >= 128:
        if fmt_code == FP32:
            warps, stages = 8, 1
        else:
            warps, stages = (4, 2) if cc >= 100 else (4, 1)
    elif DP > 16:
        warps, stages = (4, 2) if cc < 90 or (cc >= 100 and fmt_code == INT4) else (8, 2)
    else:  # the tiny test model's head size
        warps, stages = 4, 1
    return LaunchConfig(pages=max(1, TILE_SLOTS // B), warps=warps, stages=stages, precision=default_precision())


@functools.lru_cache(maxsize=None)
def target_cc(device: torch.device) -> int:
    """The launch tables' target for a device: 80 (Ampere/Ada), 90 (Hopper) or 100 (Blackwell and later);
    90 off CUDA (the interpreter runs whatever it is given)."""
    if device.type != "cuda":
        return 90
    major, _ = torch.cuda.get_device_capability(device)
    return 80 if major < 9 else 90 if major == 9 else 100


PROGRAMS_PER_SM = 4


def _num_splits(b: int, H: int, P: int, pages: int, device: torch.device) -> int:
    """Flash-decoding split of the KV axis: enough programs to keep every SM busy with a few programs each
    (a program is one (sequence, KV head) otherwise: 256 for a batch of 32 on 8 KV heads, two per SM of an
    H200, too few to hide the page loads' latency), while each split keeps >= 4 loop steps of pages."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(PROGRAMS_PER_SM * sms, b * H)
    return max(1, min(want, triton.cdiv(P, 4 * pages), 32))



def paged_attention_triton(
    q: torch.Tensor,
    slot_fields: list[torch.Tensor],
    group_fields: list[torch.Tensor],
    k_group: torch.Tensor,
    valid_bits: torch.Tensor,
    block_table: torch.Tensor,
    fmt_code: int,
    sm_scale: float,
    scale_k: float,
    scale_v: float,
    return_logits: bool,
    num_splits: int | None = None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``paged_attention_ref``; ``num_splits`` / ``config`` override the heuristics."""
    b, Hq, D = q.shape
    B, H = slot_fields[0].shape[1], slot_fields[0].shape[2]
    G = Hq // H
    P = block_table.shape[1]
    assert Hq == H * G and block_table.dtype == torch.int32 and valid_bits.dtype == torch.int32
    assert all(t.is_contiguous() for t in [*slot_fields, *group_fields, valid_bits, k_group])
    q, block_table = q.contiguous(), block_table.contiguous()
    cfg = config or launch_config(B, G, D, P, fmt_code, target_cc(q.device))
    S = num_splits or cfg.splits or _num_splits(b, H, P, cfg.pages, q.device)
    S = max(1, min(S, P)) if P else 1
    per_split = triton.cdiv(P, S) if P else 0
    dev = q.device
    out = torch.empty((b, Hq, S, D), device=dev, dtype=torch.float32)
    lse = torch.empty((b, Hq, S), device=dev, dtype=torch.float32)
    logits = torch.empty((b, Hq, P * B) if return_logits else (0,), device=dev, dtype=torch.float32)
    if b == 0:
        return out.sum(2), lse.sum(2), logits
    f = list(slot_fields) + [slot_fields[0]] * (4 - len(slot_fields))
    g = list(group_fields) + [slot_fields[0]] * (2 - len(group_fields))
    _paged_attn_kernel[(b, H, S)](
        q, *f, *g, k_group, valid_bits, block_table, out, lse, logits,
        float(sm_scale), float(scale_k), float(scale_v), P, per_split,
        FMT=fmt_code, H=H, G=G, D=D, B=B, GP=triton.next_power_of_2(G), DP=triton.next_power_of_2(D),
        PAGES=cfg.pages, NUM_SPLITS=S, RETURN_LOGITS=return_logits, PRECISION=cfg.precision, PACKED=packed_rows(D),
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if S == 1:
        return out[:, :, 0], lse[:, :, 0], logits
    o, l = merge_splits(out, lse)
    return o, l, logits
