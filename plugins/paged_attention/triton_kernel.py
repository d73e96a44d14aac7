"""Triton paged decode attention over a layer's pages in one launch, up to three storage formats at once (spec
§5.6); oracle: ``reference.py`` per format, merged by ``merge_partials``.

One program handles one (sequence, KV head, KV split) and all G query heads that share the KV head (the M
axis of the products), so each page is read and dequantized once per KV head. Each format is a constexpr: one
specialization per format (set), no per-element branching; a layer whose pages are in several formats
(ThinKV's R/E/T) gives each format its own splits of the program grid. K/V tiles are dequantized in registers
(``triton_tiles.py``) to fp16 (bf16 for bf16 pages), and both products are fp16/bf16 MMAs with fp32
accumulation; fp32 pages and ``TRTKV_TRITON_PRECISION=tf32x3`` keep fp32 tiles and three TF32 products.
Each loop step covers ``PAGES`` pages (``PAGES * B`` slots); dead slots are never loaded (masked loads) and
get ``-inf`` logits, so stale codes in evicted slots cannot leak into the output.

KV splits merge inside the launch: each program stores its partial (output, log-sum-exp), takes a ticket
from a per-(sequence, head) counter, and the last one merges all partials and resets the counter to 0, so the
counters (one persistent zeroed buffer per device) stay zero between calls and nothing else runs after the
kernel. Calls on one device must not overlap (trtkv runs one stream).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from plugins.paged_attention.reference import PagedFormat, merge_partials
from plugins.paged_attention.triton_tiles import (BF16, FP8, FP16, FP32, INT2, INT4, NVFP4, TERNARY, e4m3_unit, fold_k,
                                                  fold_v, load_kv)

MAX_FORMATS = 3  # formats per launch; a layer with more (host tiers staged beside ThinKV's) launches again


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, BF16_AS_F32: tl.constexpr):
    """``a @ b (+ acc)`` with fp32 accumulation: one fp16/bf16 MMA (``f16``), else TF32 products of fp32 tiles.
    ``BF16_AS_F32`` (the interpreter, whose bf16 dot is wrong): bf16 operands multiplied as the fp32 values
    they are, which is what the MMA computes (their products are exact in fp32)."""
    if PRECISION != "f16":
        return tl.dot(a, b, acc, input_precision=PRECISION)
    elif BF16_AS_F32 and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _attend(q, qh, gmask, offs_d, dmask, bi, h, sp, logits_ptr, LC, col0,
            f0, f1, f2, f3, g0, g1, kgrp_ptr, bits_ptr, bt_ptr, P, per_split, qk_scale, scale_k,
            FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, B: tl.constexpr, GP: tl.constexpr,
            DP: tl.constexpr, PAGES: tl.constexpr, RETURN_LOGITS: tl.constexpr, PRECISION: tl.constexpr,
            PACKED: tl.constexpr, BF16_AS_F32: tl.constexpr):
    """Online softmax of one format's split ``sp`` of the block table: running max, sum and output ``[GP, DP]``."""
    if FMT == FP32 or PRECISION != "f16":
        TD: tl.constexpr = tl.float32
    elif FMT == BF16:
        TD: tl.constexpr = tl.bfloat16
    else:
        TD: tl.constexpr = tl.float16
    qt = q.to(TD)
    offs_n = tl.arange(0, PAGES * B)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    p_lo = sp * per_split
    p_hi = tl.minimum(p_lo + per_split, P)
    for p0 in range(p_lo, p_hi, PAGES):
        pidx = p0 + offs_n // B
        slot = offs_n % B
        in_tab = pidx < p_hi
        page = tl.load(bt_ptr + bi * P + pidx, mask=in_tab, other=-1)
        word = tl.load(bits_ptr + tl.maximum(page, 0), mask=page >= 0, other=0)
        live = (page >= 0) & (((word >> slot) & 1) != 0)
        k, v = load_kv(f0, f1, f2, f3, g0, g1, kgrp_ptr, tl.maximum(page, 0), slot, live, h, offs_d, dmask,
                       scale_k, FMT, H, D, B, PAGES * B, PACKED, TD)
        # the G query heads of this KV head against the tile: a [GP, DP] x [DP, N] tensor-core product
        s = _mma(qt, tl.trans(k), None, PRECISION, BF16_AS_F32)
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))  # [GP, N]
        if RETURN_LOGITS:
            lmask = gmask[:, None] & in_tab[None, :]
            tl.store(logits_ptr + qh[:, None] * LC + (col0 + pidx * B + slot)[None, :], s, mask=lmask)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all dead so far: keep exp() finite
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _mma(p.to(TD), v, acc * alpha[:, None], PRECISION, BF16_AS_F32)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge_partials(part_out, part_lse, qh, gmask, offs_d, dmask, S, D: tl.constexpr, GP: tl.constexpr,
                    DP: tl.constexpr):
    """Log-sum-exp merge of the ``S`` partials of rows ``qh`` (volatile loads: other programs wrote them)."""
    m = tl.full([GP], float("-inf"), tl.float32)
    for s in range(0, S):
        m = tl.maximum(m, tl.load(part_lse + qh * S + s, mask=gmask, other=float("-inf"), volatile=True))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.zeros([GP], tl.float32)
    o = tl.zeros([GP, DP], tl.float32)
    for s in range(0, S):
        w = tl.exp(tl.load(part_lse + qh * S + s, mask=gmask, other=float("-inf"), volatile=True) - m_safe)
        o += w[:, None] * tl.load(part_out + (qh * S + s)[:, None] * D + offs_d[None, :],
                                  mask=gmask[:, None] & dmask[None, :], other=0.0, volatile=True)
        tot += w
    empty = tot == 0.0
    out = o / tl.where(empty, 1.0, tot)[:, None]
    return out, tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, tot)))


@triton.jit
def _paged_attn_kernel(
    q_ptr, out_ptr, lse_ptr, logits_ptr, part_out, part_lse, count_ptr, sm_scale, S, LC,
    a_f0, a_f1, a_f2, a_f3, a_g0, a_g1, a_kgrp, a_bits, a_bt, a_P, a_pps, a_qk, a_sk, a_ov, a_S, a_col,
    b_f0, b_f1, b_f2, b_f3, b_g0, b_g1, b_kgrp, b_bits, b_bt, b_P, b_pps, b_qk, b_sk, b_ov, b_S, b_col,
    c_f0, c_f1, c_f2, c_f3, c_g0, c_g1, c_kgrp, c_bits, c_bt, c_P, c_pps, c_qk, c_sk, c_ov, c_col,
    NF: tl.constexpr, FMT_A: tl.constexpr, FMT_B: tl.constexpr, FMT_C: tl.constexpr,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, B: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
    PAGES: tl.constexpr, RETURN_LOGITS: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr,
    BF16_AS_F32: tl.constexpr = False,
):
    """Program (bi, h, sp): split ``sp`` of the grid's third axis, format A's ``a_S`` splits first, then B's,
    then C's (``NF`` formats). ``x_qk``: the score scale (``sm_scale``, times the K scale where it folds),
    ``x_sk``: the K scale where the tile applies it, ``x_ov``: the V scale folded into the output."""
    bi = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    gmask = offs_g < G
    dmask = offs_d < D
    qh = bi * H * G + h * G + offs_g  # query-head rows [GP] of q [b, H*G, D]
    q = tl.load(q_ptr + qh[:, None] * D + offs_d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    if sp < a_S:
        m_i, l_i, acc = _attend(q, qh, gmask, offs_d, dmask, bi, h, sp, logits_ptr, LC, a_col,
                                a_f0, a_f1, a_f2, a_f3, a_g0, a_g1, a_kgrp, a_bits, a_bt, a_P, a_pps, a_qk, a_sk,
                                FMT_A, H, D, B, GP, DP, PAGES, RETURN_LOGITS, PRECISION, PACKED, BF16_AS_F32)
        ov = a_ov
    else:  # (static branches: a launch compiles only the formats it has)
        if NF == 1:  # no program lands here
            m_i, l_i, acc = tl.full([GP], float("-inf"), tl.float32), tl.zeros([GP], tl.float32), \
                tl.zeros([GP, DP], tl.float32)
            ov = a_ov
        elif NF == 2:
            m_i, l_i, acc = _attend(q, qh, gmask, offs_d, dmask, bi, h, sp - a_S, logits_ptr, LC, b_col,
                                    b_f0, b_f1, b_f2, b_f3, b_g0, b_g1, b_kgrp, b_bits, b_bt, b_P, b_pps, b_qk, b_sk,
                                    FMT_B, H, D, B, GP, DP, PAGES, RETURN_LOGITS, PRECISION, PACKED, BF16_AS_F32)
            ov = b_ov
        elif sp < a_S + b_S:
            m_i, l_i, acc = _attend(q, qh, gmask, offs_d, dmask, bi, h, sp - a_S, logits_ptr, LC, b_col,
                                    b_f0, b_f1, b_f2, b_f3, b_g0, b_g1, b_kgrp, b_bits, b_bt, b_P, b_pps, b_qk, b_sk,
                                    FMT_B, H, D, B, GP, DP, PAGES, RETURN_LOGITS, PRECISION, PACKED, BF16_AS_F32)
            ov = b_ov
        else:
            m_i, l_i, acc = _attend(q, qh, gmask, offs_d, dmask, bi, h, sp - a_S - b_S, logits_ptr, LC, c_col,
                                    c_f0, c_f1, c_f2, c_f3, c_g0, c_g1, c_kgrp, c_bits, c_bt, c_P, c_pps, c_qk, c_sk,
                                    FMT_C, H, D, B, GP, DP, PAGES, RETURN_LOGITS, PRECISION, PACKED, BF16_AS_F32)
            ov = c_ov
    empty = l_i == 0.0
    out = acc * (ov / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    omask = gmask[:, None] & dmask[None, :]
    if S == 1:
        tl.store(out_ptr + qh[:, None] * D + offs_d[None, :], out, mask=omask)
        tl.store(lse_ptr + qh, lse, mask=gmask)
    else:
        prow = qh * S + sp  # partials [b, Hq, S, D] / [b, Hq, S]
        tl.store(part_out + prow[:, None] * D + offs_d[None, :], out, mask=omask)
        tl.store(part_lse + prow, lse, mask=gmask)
        tl.debug_barrier()  # every thread's partial stored before the ticket releases them
        ticket = tl.atomic_add(count_ptr + bi * H + h, 1, sem="acq_rel")
        if ticket == S - 1:  # the last split of this (sequence, KV head): merge, then zero the counter
            o, lse_all = _merge_partials(part_out, part_lse, qh, gmask, offs_d, dmask, S, D, GP, DP)
            tl.store(out_ptr + qh[:, None] * D + offs_d[None, :], o, mask=omask)
            tl.store(lse_ptr + qh, lse_all, mask=gmask)
            tl.atomic_xchg(count_ptr + bi * H + h, 0)


def packed_rows(D: int) -> bool:
    """Whether a head's code bytes and per-16 fields load as whole rows (power-of-two ``D >= 32``: every
    sub-row ``arange`` is a power of two) rather than one load per element. ``D = 16`` loads per element: its
    packed rows gave wrong values for every 4-/2-bit format on an H200 (Triton 3.6, 2026-11-27; right in the
    interpreter and at D = 32/64/128 on the same GPU; not root-caused)."""
    return D >= 32 and D & (D - 1) == 0


PRECISIONS = ("f16", "tf32x3", "tf32")


def default_precision() -> str:
    """``f16`` (default): K/V tiles, q and P in fp16 (bf16 for bf16 pages), one MMA per product, fp32
    accumulation; exact tiles for the float and E2M1/E4M3/ternary formats, one fp16 rounding of int4/int2 and
    offset keys, P rounded as FlashAttention rounds it. ``tf32x3``: fp32 tiles and three TF32 products per dot
    (hi*hi + hi*lo + lo*hi), fp32-accurate (the reference's 3e-5 holds; fp32 pages always use it).
    ``tf32``: one TF32 product on fp32 tiles."""
    p = os.environ.get("TRTKV_TRITON_PRECISION", "f16")
    if p not in PRECISIONS:
        from trtkv.errors import TrtkvError

        raise TrtkvError(f"TRTKV_TRITON_PRECISION={p!r} is not one of {', '.join(PRECISIONS)}; unset it or pick one")
    return p


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is tiled: slots per loop step (``pages * B``), warps and pipeline stages per program,
    KV splits per format (``None``: the heuristic in ``split_counts``) and the products' precision."""

    pages: int
    warps: int
    stages: int
    splits: int | None = None
    precision: str = PRECISIONS[0]


TILE_SLOTS = 32  # slots per loop step (>= 16: the K extent of the P @ V product on the tensor cores)


# (slots a loop step, warps, stages) of one format read without logits at D = 128, G <= 4 on sm_90, timed on an
# H200 against the 32 x 8 x 2 default (docs/benchmarks.md "GPU", 2026-12-04, batch 32 x 16k): fp16 763 -> 661 us,
# fp8 3538 -> 1787, nvfp4 4429 -> 1868, int4 1711 -> 1094, int2 1389 -> 1083, ternary 4136 -> 1678 (bf16 runs
# fp16's code and timed the same at the default)
SM90_LEAN = {FP16.value: (64, 8, 2), BF16.value: (64, 8, 2), FP8.value: (32, 4, 2), NVFP4.value: (32, 4, 3),
             INT4.value: (32, 4, 3), INT2.value: (32, 4, 3), TERNARY.value: (32, 4, 2)}
# several quantized formats in one launch (ThinKV's R/E/T) without logits, same conditions: nvfp4+ternary on an
# H200 (2026-12-04 evening, tree e4eb18b) against 32 x 8 x 2: b=32 x 16k 1,683 -> 1,050 us, b=256 x 2k 1,787 -> 1,036
SM90_SETS = (32, 4, 3)


def launch_config(B: int, G: int, D: int, P: int, fmt_code: int, cc: int = 90, lean: bool = False,
                  formats: int = 1) -> LaunchConfig:
    """The default tiling at the precision ``TRTKV_TRITON_PRECISION`` asks for (see ``tiling``); ``lean``: read
    without logits; ``formats``: formats in the launch (``fmt_code`` the one with the most pages)."""
    return tiling(B, G, D, P, fmt_code, cc, default_precision(), lean, formats)


@functools.lru_cache(maxsize=None)
def tiling(B: int, G: int, D: int, P: int, fmt_code: int, cc: int, precision: str, lean: bool = False,
           formats: int = 1) -> LaunchConfig:
    """The default tiling: ``TILE_SLOTS`` slots a loop step, the warps and (>= 2) pipeline stages per head size,
    format and target ``cc`` (``target_cc``) that ptxas allocates without spills (tests/kernels/test_triton_aot.py
    compiles every default specialization for sm_80, sm_90 and sm_100; docs/kernels.md has the table). fp32
    pages keep fp32 tiles and ``tf32x3`` products under the default ``f16``. ``P`` does not cap the tile: lanes
    past the block table are masked, and the tile must stay >= 16 slots."""
    if fmt_code == FP32.value and precision == "f16":
        precision = "tf32x3"
    DP = triton.next_power_of_2(D)
    if lean and cc == 90 and DP == 128 and G <= 4 and precision == "f16" and fmt_code in SM90_LEAN and \
            (formats == 1 or fmt_code not in (FP16.value, BF16.value)):  # (a set led by fp16: the default)
        slots, warps, stages = SM90_LEAN[fmt_code] if formats == 1 else SM90_SETS
        return LaunchConfig(pages=max(1, slots // B), warps=warps, stages=stages, precision=precision)
    if DP >= 64:
        if fmt_code == FP32.value and DP == 64 and cc == 90:
            warps, stages = 8, 1  # 8 x 2 and 4 x 2 spill 8 B
        elif fmt_code in (FP16.value, BF16.value) and DP >= 128 and cc < 90:
            warps, stages = 4, 2  # 8 x 2 spills 8 B
        elif fmt_code == FP8.value and DP >= 128 and cc < 90:
            warps, stages = 8, 3  # 8 x 2 spills 8 B with logits, 4 x 2 in ThinKV's sets
        elif fmt_code == NVFP4.value and DP >= 128 and cc < 90 and G > 4:
            warps, stages = 4, 3  # 8 x 2 spills 8 B in ThinKV's sets at G = 7
        else:
            warps, stages = 8, 2  # 4 x 2 spills at D = 128 (8-96 B: nvfp4o, ThinKV's sets with logits)
    elif DP > 16:  # (no registry model; the tests' D = 32)
        warps, stages = (4, 2) if cc < 90 else (8, 2)
    else:  # the tiny test model's head size
        warps, stages = 4, 2
    return LaunchConfig(pages=max(1, TILE_SLOTS // B), warps=warps, stages=stages, precision=precision)


@functools.lru_cache(maxsize=None)
def target_cc(device: torch.device) -> int:
    """The launch tables' target for a device: 80 (Ampere/Ada), 90 (Hopper) or 100 (Blackwell and later);
    90 off CUDA (the interpreter runs whatever it is given)."""
    if device.type != "cuda":
        return 90
    major, _ = torch.cuda.get_device_capability(device)
    return 80 if major < 9 else 90 if major == 9 else 100


PROGRAMS_PER_SM = 4  # programs the grid keeps on every SM, at every batch and length the table allows
MIN_STEPS_PER_SPLIT = 2  # loop steps of pages a split keeps at least
MAX_SPLITS = 128


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_counts(b: int, H: int, pages_per_format: tuple[int, ...], pages: int, device: torch.device,
                 override: int | None = None) -> list[int]:
    """Flash-decoding splits of each format's KV axis: ``PROGRAMS_PER_SM`` programs per SM across the grid
    (a program is one (sequence, KV head) otherwise: 256 for a batch of 32 on 8 KV heads, two per SM of an
    H200, too few to hide the page loads' latency), shared among the formats by their pages, each split keeping
    ``MIN_STEPS_PER_SPLIT`` loop steps; one split a format off CUDA; none for a format without pages."""
    total = sum(pages_per_format)
    if override:
        return [min(override, P) for P in pages_per_format]
    if device.type != "cuda" or not total:
        return [1 if P else 0 for P in pages_per_format]
    want = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), b * H)
    return [max(1, min(round(want * P / total), triton.cdiv(P, MIN_STEPS_PER_SPLIT * pages), MAX_SPLITS)) if P else 0
            for P in pages_per_format]


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's split-merge tickets, zero between calls (the merging program resets its own)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def reserve_counters(device: torch.device, n: int = 1 << 16) -> None:
    """Allocate the device's tickets for up to ``n`` (sequence, KV head) pairs now (CUDA graphs: outside a
    recording's memory pool, and never reallocated while one records)."""
    _counters(device, n)


def _format_args(src: PagedFormat, splits: int, col: int, sm_scale: float, with_splits: bool = True) -> tuple:
    f = list(src.slot_fields) + [src.slot_fields[0]] * (4 - len(src.slot_fields))
    g = list(src.group_fields) + [src.slot_fields[0]] * (2 - len(src.group_fields))
    P = src.block_table.shape[1]
    unit = e4m3_unit(src.fmt_code)  # (a power of two: each scale below is exactly unit times the layer's)
    qk = sm_scale * (src.scale_k * unit if fold_k(src.fmt_code) else 1.0)
    ov = src.scale_v * unit if fold_v(src.fmt_code) else 1.0
    head = (*f, *g, src.k_group, src.valid_bits, src.block_table, P, triton.cdiv(P, splits) if splits else 0,
            float(qk), float(src.scale_k * unit), float(ov))
    return (*head, splits, col) if with_splits else (*head, col)


def paged_attention_formats_triton(q: torch.Tensor, sources: list[PagedFormat], sm_scale: float,
                                   return_logits: bool, num_splits: int | None = None,
                                   config: LaunchConfig | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``q [b, Hq, D]`` over every source's pages, merged: ``(out, lse, logits)`` with the
    sources' logits side by side in their order (``[b, Hq, sum(P * B)]``). One launch for up to
    ``MAX_FORMATS`` sources; ``num_splits`` (per format) / ``config`` override the heuristics."""
    if len(sources) > MAX_FORMATS:
        parts = [paged_attention_formats_triton(q, sources[i:i + MAX_FORMATS], sm_scale, return_logits, num_splits,
                                                config) for i in range(0, len(sources), MAX_FORMATS)]
        out, lse = merge_partials([(o, s) for o, s, _ in parts])
        return out, lse, torch.cat([lg for _, _, lg in parts], dim=-1) if return_logits else parts[0][2]
    b, Hq, D = q.shape
    B, H = sources[0].slot_fields[0].shape[1], sources[0].slot_fields[0].shape[2]
    G = Hq // H
    Ps = tuple(s.block_table.shape[1] for s in sources)
    assert Hq == H * G and all(s.block_table.dtype == torch.int32 and s.valid_bits.dtype == torch.int32
                               for s in sources)
    assert all(t.is_contiguous() for s in sources for t in [*s.slot_fields, *s.group_fields, s.valid_bits, s.k_group])
    sources = [s if s.block_table.is_contiguous() else replace(s, block_table=s.block_table.contiguous())
               for s in sources]
    q = q.contiguous()
    main = max(range(len(sources)), key=lambda i: Ps[i])
    cfg = config or launch_config(B, G, D, Ps[main], sources[main].fmt_code, target_cc(q.device),
                                  lean=not return_logits, formats=len(sources))
    Ss = split_counts(b, H, Ps, cfg.pages, q.device, num_splits or cfg.splits)
    S = sum(Ss)
    dev = q.device
    out = torch.empty((b, Hq, D), device=dev, dtype=torch.float32)
    lse = torch.empty((b, Hq), device=dev, dtype=torch.float32)
    logits = torch.empty((b, Hq, sum(Ps) * B) if return_logits else (0,), device=dev, dtype=torch.float32)
    if b == 0 or S == 0:  # nothing live anywhere
        return out.zero_(), lse.fill_(float("-inf")), logits
    part_out = torch.empty((b, Hq, S, D), device=dev, dtype=torch.float32) if S > 1 else out
    part_lse = torch.empty((b, Hq, S), device=dev, dtype=torch.float32) if S > 1 else lse
    cols = [B * sum(Ps[:i]) for i in range(len(sources))]
    fa = [_format_args(s, n, c, sm_scale, i < 2) for i, (s, n, c) in enumerate(zip(sources, Ss, cols))]
    fa += [fa[0] if i < 2 else fa[0][:-2] + fa[0][-1:] for i in range(len(fa), MAX_FORMATS)]
    codes = [s.fmt_code for s in sources] + [sources[0].fmt_code] * (MAX_FORMATS - len(sources))
    _paged_attn_kernel[(b, H, S)](
        q, out, lse, logits, part_out, part_lse, _counters(dev, b * H), float(sm_scale), S, logits.shape[-1],
        *fa[0], *fa[1], *fa[2],
        NF=len(sources), FMT_A=codes[0], FMT_B=codes[1], FMT_C=codes[2], H=H, G=G, D=D, B=B,
        GP=triton.next_power_of_2(G), DP=triton.next_power_of_2(D), PAGES=cfg.pages, RETURN_LOGITS=return_logits,
        PRECISION=cfg.precision, PACKED=packed_rows(D), BF16_AS_F32=dev.type != "cuda",
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out, lse, logits


def paged_attention_triton(q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code, sm_scale,
                           scale_k, scale_v, return_logits, num_splits: int | None = None,
                           config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``paged_attention_ref`` (one format); ``num_splits`` / ``config`` override the heuristics."""
    src = PagedFormat(list(slot_fields), list(group_fields), k_group, valid_bits, block_table, fmt_code, scale_k,
                      scale_v)
    return paged_attention_formats_triton(q, [src], sm_scale, return_logits, num_splits, config)
