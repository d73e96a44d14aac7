"""Triton paged attention against the torch reference, for every registered format (spec §9 items 18-20).

Pools are filled through the reference ``kv_write`` (so every slot holds real codes of its format,
as after eviction), validity bits are random, and block tables carry -1 padding.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from plugins.formats import FORMATS
from plugins.formats.e4m3 import e4m3_decode
from plugins.formats.nvfp4 import e2m1_decode
from plugins.formats.ternary import ternary_decode
from plugins.kv_write.reference import kv_write_ref
from plugins.paged_attention.reference import paged_attention_ref
from plugins.paged_attention.triton_tiles import _e2m1, _e4m3, _tern

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before Python starts)",
)

B = 8
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# (b, H, G, D, P): sequences, KV heads, query heads per KV head, head dim, block-table width
# D = 48 is not a power of two: codes load per element (the packed-row path covers the others)
SHAPES = [(3, 2, 3, 32, 3), (2, 1, 1, 64, 4), (1, 2, 2, 16, 2), (2, 2, 2, 48, 3)]


def make_pool(fmt, H, D, num_pages, seed, scales=(0.7, 1.3)):
    """Every slot written with real codes (random flush groups of <= group_size scattered slots)."""
    g = torch.Generator().manual_seed(seed)
    slot = [torch.zeros((num_pages, B, *f.shape), dtype=f.dtype) for f in fmt.slot_fields(H, D)]
    n_slots = num_pages * B
    groups = math.ceil(n_slots / fmt.group_size) if fmt.quantized else 1
    group = [torch.zeros((groups, *f.shape), dtype=f.dtype) for f in fmt.group_fields(H, D)]
    k_group = torch.full((num_pages, B), -1, dtype=torch.int32)
    order = torch.randperm(n_slots, generator=g)
    chunk = fmt.group_size if fmt.quantized else n_slots
    offset = torch.randn(H, D, generator=g) * 3  # a per-channel key offset, as real keys have
    for gid, i in enumerate(range(0, n_slots, chunk)):
        idx = order[i : i + chunk]
        k = torch.randn(len(idx), H, D, generator=g) * 2 + offset
        v = torch.randn(len(idx), H, D, generator=g)
        kv_write_ref(k, v, slot, group, k_group, idx // B, idx % B, gid, fmt.code, *scales)
    bits = torch.randint(0, 1 << B, (num_pages,), generator=g, dtype=torch.int32)
    to = lambda ts: [t.to(DEV) for t in ts]  # noqa: E731
    return to(slot), to(group), k_group.to(DEV), bits.to(DEV)


def make_table(b, P, num_pages, seed):
    """Distinct pages per row, a random tail of -1 padding (row 0 keeps all P)."""
    g = torch.Generator().manual_seed(seed)
    bt = torch.stack([torch.randperm(num_pages, generator=g)[:P] for _ in range(b)]).int()
    for r in range(1, b):
        bt[r, P - int(torch.randint(0, P, (1,), generator=g)) :] = -1
    return bt.to(DEV)


def config(fmt, q, precision: str | None):
    """The default launch configuration at ``precision`` (None: the default precision)."""
    from plugins.paged_attention.triton_kernel import launch_config

    b, Hq, D = q.shape
    cfg = launch_config(B, 1, D, 1, fmt.code)
    return cfg if precision is None or fmt.code == 0 else replace(cfg, precision=precision)


def run_both(fmt, q, pool, bt, scales=(0.7, 1.3), precision=None, **kw):
    from plugins.paged_attention.triton_kernel import paged_attention_triton

    slot, group, k_group, bits = pool
    args = (q, slot, group, k_group, bits, bt, fmt.code, q.shape[-1] ** -0.5, *scales, True)
    return paged_attention_triton(*args, config=config(fmt, q, precision), **kw), paged_attention_ref(*args)


ENV_PRECISION = os.environ.get("TRTKV_TRITON_PRECISION", "f16")


def tolerance(name: str, precision: str | None = None) -> float:
    """3e-5 for fp32-accurate products (fp32 pages, ``tf32x3``). ``f16`` rounds q and P to fp16 (2^-11
    relative; the int4/int2 tiles and the offset keys once too), which these logits (|s| <~ 10) and outputs
    carry as <= 3e-3 (measured: 2.2e-3 fp16, 3.1e-3 int4); bf16 pages round q and P to bf16 (2^-8): 1.3e-2.
    ``tf32`` (one TF32 product) rounds to a 10-bit mantissa, like fp16. A wrong slot, scale or mask still
    shows as an error of order 0.1-1."""
    precision = precision or ENV_PRECISION
    if name == "fp32" or precision == "tf32x3":
        return 3e-5
    return 2.5e-2 if name == "bf16" and precision == "f16" else 5e-3


def assert_same(got, want, name, precision=None):
    tol = tolerance(name, precision)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol)


@pytest.mark.parametrize("precision", ["f16", "tf32x3"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}H{}G{}D{}P{}".format(*s))
@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_reference(name, shape, precision):
    b, H, G, D, P = shape
    fmt = FORMATS[name]
    pool = make_pool(fmt, H, D, num_pages=6, seed=D + G)
    q = torch.randn(b, H * G, D, generator=torch.Generator().manual_seed(1)).to(DEV)
    got, want = run_both(fmt, q, pool, make_table(b, P, 6, seed=b), precision=precision)
    assert got[2].shape == (b, H * G, P * B)
    assert_same(got, want, name, precision)


@pytest.mark.parametrize("code", [1, 2, 3, 4, 5, 6, 7])
def test_sm90_lean_tilings_match_reference(code):
    """The tilings measured on an H200 for one format read without logits (``SM90_LEAN``: 64 slots a loop step for
    fp16/bf16, 4 warps for fp8 and the 4-/2-bit formats) at r1-llama-8b's head size, two KV splits."""
    from plugins.formats import format_by_code
    from plugins.paged_attention.triton_kernel import SM90_LEAN, paged_attention_triton, tiling

    fmt = format_by_code(code)
    cfg = tiling(B, 4, 128, 20, code, 90, "f16", lean=True)
    assert code in SM90_LEAN and (cfg.pages * B, cfg.warps, cfg.stages) == SM90_LEAN[code]
    pool = make_pool(fmt, 1, 128, num_pages=24, seed=code)
    q = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(code)).to(DEV)
    bt = make_table(2, 20, 24, seed=code)
    args = (q, *pool[:4], bt, code, 128 ** -0.5, 0.7, 1.3, False)
    got = paged_attention_triton(*args, num_splits=2, config=cfg)
    assert_same(got[:2], paged_attention_ref(*args)[:2], fmt.name)


@pytest.mark.parametrize("name", ["fp16", "nvfp4", "ternaryo", "int2"])
def test_split_kv_matches(name):
    fmt = FORMATS[name]
    pool = make_pool(fmt, 2, 32, num_pages=8, seed=3)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(2)).to(DEV)
    bt = make_table(2, 7, 8, seed=5)
    got, want = run_both(fmt, q, pool, bt, num_splits=3)
    assert_same(got, want, name)


def test_all_dead_rows_give_zero_and_neg_inf():
    fmt = FORMATS["fp32"]
    slot, group, k_group, bits = make_pool(fmt, 1, 16, num_pages=3, seed=0)
    bits[1] = 0
    bt = torch.tensor([[-1, -1], [1, -1], [2, 0]], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 2, 16).to(DEV)
    (out, lse, logits), want = run_both(fmt, q, (slot, group, k_group, bits), bt)
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == -math.inf) and torch.all(logits[:2] == -math.inf)
    assert_same((out, lse, logits), want, "fp32")


@pytest.mark.parametrize("name", list(FORMATS))
def test_dead_slot_codes_change_nothing(name):
    """§9 item 18: overwrite every evicted slot (codes, scales, group ids) with garbage."""
    from plugins.paged_attention.triton_kernel import paged_attention_triton

    fmt = FORMATS[name]
    slot, group, k_group, bits = make_pool(fmt, 2, 16, num_pages=4, seed=7)
    bt = torch.tensor([[0, 1, 2], [3, 2, -1]], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 4, 16).to(DEV)
    args = lambda s, kg: (q, s, group, kg, bits, bt, fmt.code, 0.25, 0.7, 1.3, True)  # noqa: E731
    before = paged_attention_triton(*args(slot, k_group))
    dead = ((bits[:, None] >> torch.arange(B, device=DEV, dtype=torch.int32)) & 1) == 0  # [pages, B]
    g = torch.Generator().manual_seed(0)
    junk = []
    for t in slot:
        noise = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8).to(DEV) if t.dtype == torch.uint8 \
            else torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEV)
        junk.append(torch.where(dead.view(*dead.shape, *[1] * (t.dim() - 2)), noise, t))
    kg = torch.where(dead, torch.randint(0, 10**6, k_group.shape, generator=g, dtype=torch.int32).to(DEV), k_group)
    after = paged_attention_triton(*args(junk, kg))
    for x, y in zip(before, after):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["fp32", "fp8", "nvfp4o", "int4"])
def test_page_order_permutation_invariant(name):
    """§9 item 19: output and lse do not depend on the page order in the block table."""
    from plugins.paged_attention.triton_kernel import paged_attention_triton

    fmt = FORMATS[name]
    slot, group, k_group, bits = make_pool(fmt, 2, 32, num_pages=6, seed=11)
    bt = torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 2, 32).to(DEV)
    run = lambda t: paged_attention_triton(q, slot, group, k_group, bits, t, fmt.code, 0.2, 0.7, 1.3, False)  # noqa: E731
    out, lse, _ = run(bt)
    out2, lse2, _ = run(bt[:, torch.tensor([4, 0, 5, 2, 1, 3], device=DEV)].contiguous())
    tol = 1e-5 if tolerance(name) < 1e-4 else 5e-3  # rounded P: two page orders round differently
    torch.testing.assert_close(out2, out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse2, lse, atol=tol, rtol=tol)


def test_op_dispatches_to_triton(monkeypatch):
    import plugins.ops  # noqa: F401
    import plugins.paged_attention.triton_kernel as tk

    calls = []
    real = tk.paged_attention_triton
    monkeypatch.setattr(tk, "paged_attention_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("TRTKV_KERNELS", "triton")
    fmt = FORMATS["fp16"]
    slot, group, k_group, bits = make_pool(fmt, 1, 16, num_pages=2, seed=0)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 1, 16).to(DEV)
    out, lse, logits = torch.ops.trtkv.paged_attention(q, slot, group, k_group, bits, bt, fmt.code, 0.25, 1.0, 1.0, False)
    assert calls and out.shape == (1, 1, 16) and logits.numel() == 0


FORMAT_SETS = [("nvfp4", "ternary"), ("fp8", "nvfp4", "ternary"), ("int4", "int2", "bf16"),
               ("fp16", "nvfp4o", "ternaryo", "int4"), ("nvfp4", "ternary", "fp16")]


@pytest.mark.parametrize("splits", [None, 2])
@pytest.mark.parametrize("names", FORMAT_SETS, ids="-".join)
def test_formats_in_one_launch_match_each_format_merged(names, splits):
    """A layer's pages in several formats (ThinKV's R/E/T) in one launch (two past three formats): the same
    output and lse as one reference call a format merged by log-sum-exp, the logits side by side; the last
    set's fp16 has no pages left (no program), and the split tickets are back to zero after the call."""
    from plugins.paged_attention.reference import merge_partials
    from plugins.paged_attention.triton_kernel import _COUNTERS, PagedFormat, paged_attention_formats_triton

    b, H, G, D = 3, 2, 2, 32
    q = torch.randn(b, H * G, D, generator=torch.Generator().manual_seed(4)).to(DEV)
    sources, parts, logits = [], [], []
    for i, name in enumerate(names):
        fmt = FORMATS[name]
        slot, group, k_group, bits = make_pool(fmt, H, D, num_pages=6, seed=10 + i)
        P = 0 if (i == 2 and name == "fp16") else (2, 4, 3, 1)[i]
        bt = make_table(b, P, 6, seed=20 + i) if P else torch.empty((b, 0), dtype=torch.int32, device=DEV)
        scales = (0.7 + 0.1 * i, 1.3 - 0.1 * i)
        sources.append(PagedFormat(slot, group, k_group, bits, bt, fmt.code, *scales))
        o, lse, lg = paged_attention_ref(q, slot, group, k_group, bits, bt, fmt.code, 0.2, *scales, True)
        parts.append((o, lse))
        logits.append(lg)
    want = (*merge_partials(parts), torch.cat(logits, dim=-1))
    got = paged_attention_formats_triton(q, sources, 0.2, True, num_splits=splits)
    tol = max(tolerance(n) for n in names)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_op_dispatches_formats_to_one_launch(monkeypatch):
    """``plugins.ops.paged_attention_formats`` on the Triton path: one kernel call for two formats, one merged
    partial; on the other paths one partial a format (what the merge after it expects)."""
    import plugins.ops as ops
    import plugins.paged_attention.triton_kernel as tk

    calls = []
    real = tk.paged_attention_formats_triton
    monkeypatch.setattr(tk, "paged_attention_formats_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    srcs = []
    for i, name in enumerate(["nvfp4", "ternary"]):
        slot, group, k_group, bits = make_pool(FORMATS[name], 1, 32, num_pages=3, seed=i)
        srcs.append(tk.PagedFormat(slot, group, k_group, bits, make_table(2, 2, 3, seed=i), FORMATS[name].code,
                                   1.0, 1.0))
    q = torch.randn(2, 2, 32).to(DEV)
    monkeypatch.setenv("TRTKV_KERNELS", "triton")
    parts, logits = ops.paged_attention_formats(q, srcs, 0.2, True)
    assert len(calls) == 1 and len(parts) == 1 and len(logits) == 1 and logits[0].shape == (2, 2, 32)
    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    ref_parts, ref_logits = ops.paged_attention_formats(q, srcs, 0.2, True)
    assert len(calls) == 1 and len(ref_parts) == 2 and len(ref_logits) == 2
    from plugins.paged_attention.reference import merge_partials

    for a, e in zip(parts[0], merge_partials(ref_parts)):
        torch.testing.assert_close(a, e, atol=5e-3, rtol=5e-3)



@triton.jit
def _decode_every_code(src, e4, e2, tn):
    b = tl.load(src + tl.arange(0, 256))
    tl.store(e4 + tl.arange(0, 256), _e4m3(b).to(tl.float32) * 256.0)  # (e4m3_unit: the caller's 256)
    tl.store(e2 + tl.arange(0, 256), _e2m1(b & 15))
    tl.store(tn + tl.arange(0, 256), _tern(b & 3))


def test_tile_decoders_exact_for_every_code():
    """The tiles' E4M3 (all 256 bytes, NaN included; times its 256), E2M1 (16 nibbles) and ternary (4 crumbs)
    decoders give the formats' torch decodes exactly, signed zeros included."""
    codes = torch.arange(256, dtype=torch.int32)
    outs = [torch.empty(256, dtype=dt, device=DEV) for dt in (torch.float32, torch.float16, torch.float16)]
    _decode_every_code[(1,)](codes.to(DEV), *outs)
    want = [e4m3_decode(codes.to(torch.uint8)), e2m1_decode(codes & 15), ternary_decode(codes & 3)]
    for got, ref in zip(outs, want):
        got, ref = got.cpu(), ref.to(got.dtype)
        torch.testing.assert_close(got, ref, atol=0, rtol=0, equal_nan=True)
        assert (torch.signbit(got) == torch.signbit(ref))[~ref.isnan()].all(), "a signed zero differs"


def test_sm90_set_tiling_matches_reference():
    """ThinKV's formats in one launch without logits at r1-llama-8b's head size take ``SM90_SETS`` on sm_90 (a
    set led by fp16 keeps the default); the launch at that tiling matches one reference call a format merged."""
    from plugins.paged_attention.reference import merge_partials
    from plugins.paged_attention.triton_kernel import (SM90_SETS, TILE_SLOTS, PagedFormat,
                                                       paged_attention_formats_triton, tiling)

    cfg = tiling(B, 4, 128, 20, FORMATS["nvfp4"].code, 90, "f16", lean=True, formats=2)
    assert (cfg.pages * B, cfg.warps, cfg.stages) == SM90_SETS
    assert tiling(B, 4, 128, 20, FORMATS["nvfp4"].code, 90, "f16", lean=False, formats=2).warps == 8  # logits
    fp16_led = tiling(B, 4, 128, 20, FORMATS["fp16"].code, 90, "f16", lean=True, formats=2)
    assert (fp16_led.pages * B, fp16_led.warps) == (TILE_SLOTS, 8)
    q = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(5)).to(DEV)
    sources, parts = [], []
    for i, name in enumerate(("nvfp4", "ternary", "fp8")):
        fmt = FORMATS[name]
        slot, group, k_group, bits = make_pool(fmt, 1, 128, num_pages=12, seed=30 + i)
        bt = make_table(2, (9, 5, 2)[i], 12, seed=40 + i)
        sources.append(PagedFormat(slot, group, k_group, bits, bt, fmt.code, 0.7, 1.3))
        parts.append(paged_attention_ref(q, slot, group, k_group, bits, bt, fmt.code, 0.1, 0.7, 1.3, False)[:2])
    got = paged_attention_formats_triton(q, sources, 0.1, False, config=cfg)
    tol = max(tolerance(n) for n in ("nvfp4", "ternary", "fp8"))
    for a, e in zip(got[:2], merge_partials(parts)):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol)
