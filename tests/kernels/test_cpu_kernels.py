"""The compiled CPU kernels (plugins/cpu_kernels) against the torch references, the slow oracles.

Attention: every format, holes (random validity words), permuted and -1-padded block tables, GQA
G=1/3/4, sequences of different lengths and empty ones, splits, ``return_logits``, garbage in dead
slots, and a large pool. kv_write: byte-identical pools, arena and ``k_group`` for every format,
including the encoders' rounding ties, saturating scales and half inputs (the Triton test's cases).
"""
from __future__ import annotations

import math

import pytest
import torch
from test_kv_write_triton import TIES, assert_bitwise, pools, scatter, tensors, tie_tensors
from test_paged_attention_triton import make_pool, make_table

from plugins.cpu_kernels import cpu_kernels_available, kv_write_cpu, kv_write_groups_cpu, paged_attention_cpu
from plugins.formats import FORMATS
from plugins.kv_write.reference import kv_write_groups_ref, kv_write_ref
from plugins.paged_attention.reference import merge_partials, paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here")

B = 8
assert TIES  # the kv_write cases below come from the Triton test: keep them in one place


def on_cpu(pool):
    slot, group, k_group, bits = pool
    return [t.cpu() for t in slot], [t.cpu() for t in group], k_group.cpu(), bits.cpu()


def run_both(fmt, q, pool, bt, scales=(0.7, 1.3), logits=True, splits=None):
    slot, group, k_group, bits = on_cpu(pool)
    args = (q, slot, group, k_group, bits, bt.cpu(), fmt.code, q.shape[-1] ** -0.5, *scales, logits)
    return paged_attention_cpu(*args, num_splits_override=splits), paged_attention_ref(*args)


def assert_same(got, want):
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, atol=3e-5, rtol=3e-5)


# (b, H, G, D, P): sequences, KV heads, query heads per KV head, head dim, block-table width
SHAPES = [(3, 2, 3, 32, 3), (2, 1, 1, 64, 4), (4, 2, 4, 16, 5), (1, 3, 3, 128, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}H{}G{}D{}P{}".format(*s))
@pytest.mark.parametrize("name", list(FORMATS))
def test_attention_matches_reference(name, shape):
    b, H, G, D, P = shape
    fmt = FORMATS[name]
    pool = make_pool(fmt, H, D, num_pages=7, seed=D + G)
    q = torch.randn(b, H * G, D, generator=torch.Generator().manual_seed(1))
    bt = make_table(b, P, 7, seed=b).cpu()  # rows of different lengths (-1 tails), permuted pages
    for logits in (True, False):
        got, want = run_both(fmt, q, pool, bt, logits=logits)
        assert_same(got, want)


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("name", ["fp16", "nvfp4", "ternaryo", "int2", "bf16"])
def test_splits_match(name, splits):
    fmt = FORMATS[name]
    pool = make_pool(fmt, 2, 32, num_pages=9, seed=3)
    q = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(2))
    got, want = run_both(fmt, q, pool, make_table(3, 8, 9, seed=5), splits=splits)
    assert_same(got, want)


def test_empty_sequences_and_dead_pages():
    fmt = FORMATS["nvfp4"]
    slot, group, k_group, bits = on_cpu(make_pool(fmt, 1, 16, num_pages=3, seed=0))
    bits[1] = 0
    bt = torch.tensor([[-1, -1], [1, -1], [2, 0]], dtype=torch.int32)
    q = torch.randn(3, 2, 16)
    (out, lse, logits), want = run_both(fmt, q, (slot, group, k_group, bits), bt, splits=2)
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == -math.inf) and torch.all(logits[:2] == -math.inf)
    assert_same((out, lse, logits), want)
    got = paged_attention_cpu(q[:0], slot, group, k_group, bits, bt[:0], fmt.code, 0.25, 1.0, 1.0, True)
    assert [tuple(t.shape) for t in got] == [(0, 2, 16), (0, 2), (0, 2, 16)]
    got = paged_attention_cpu(q, slot, group, k_group, bits, bt[:, :0], fmt.code, 0.25, 1.0, 1.0, False)
    assert torch.all(got[0] == 0) and torch.all(got[1] == -math.inf)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dead_slot_garbage_changes_nothing(name):
    fmt = FORMATS[name]
    slot, group, k_group, bits = on_cpu(make_pool(fmt, 2, 16, num_pages=4, seed=7))
    bt = torch.tensor([[0, 1, 2], [3, 2, -1]], dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    run = lambda s, kg: paged_attention_cpu(q, s, group, kg, bits, bt, fmt.code, 0.25, 0.7, 1.3, True)  # noqa: E731
    before = run(slot, k_group)
    dead = ((bits[:, None] >> torch.arange(B, dtype=torch.int32)) & 1) == 0
    g = torch.Generator().manual_seed(0)
    junk = []
    for t in slot:
        noise = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8) if t.dtype == torch.uint8 \
            else torch.full(t.shape, float("nan"), dtype=t.dtype)
        junk.append(torch.where(dead.view(*dead.shape, *[1] * (t.dim() - 2)), noise, t))
    kg = torch.where(dead, torch.randint(0, 10**6, k_group.shape, generator=g, dtype=torch.int32), k_group)
    for x, y in zip(before, run(junk, kg)):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["fp32", "fp8", "nvfp4o", "int4"])
def test_page_permutation_invariant_and_partials_merge(name):
    fmt = FORMATS[name]
    slot, group, k_group, bits = on_cpu(make_pool(fmt, 2, 32, num_pages=6, seed=11))
    q = torch.randn(1, 2, 32)
    run = lambda t: paged_attention_cpu(q, slot, group, k_group, bits, t, fmt.code, 0.2, 0.7, 1.3, False)  # noqa: E731
    bt = torch.arange(6, dtype=torch.int32)[None]
    out, lse, _ = run(bt)
    out2, lse2, _ = run(bt[:, [4, 0, 5, 2, 1, 3]].contiguous())
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse2, lse, atol=1e-5, rtol=1e-5)
    a, b = run(bt[:, :2].contiguous()), run(bt[:, 2:].contiguous())  # as two formats' partials
    mo, ml = merge_partials([a[:2], b[:2]])
    torch.testing.assert_close(mo, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ml, lse, atol=1e-5, rtol=1e-5)


def test_large_pool_64bit_offsets():
    """~100k pages: the kernel reads the last pages of a big pool through int64 offsets."""
    fmt = FORMATS["ternary"]
    H, D, n_pages = 1, 16, 100_000
    slot = [torch.zeros((n_pages, B, *f.shape), dtype=f.dtype) for f in fmt.slot_fields(H, D)]
    group = [torch.zeros((n_pages, *f.shape), dtype=f.dtype) for f in fmt.group_fields(H, D)]
    k_group = torch.full((n_pages, B), -1, dtype=torch.int32)
    bits = torch.zeros(n_pages, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    tail = torch.arange(n_pages - 6, n_pages)
    for i, p in enumerate(tail.tolist()):
        k, v = torch.randn(B, H, D, generator=g), torch.randn(B, H, D, generator=g)
        kv_write_cpu(k, v, slot, group, k_group, torch.full((B,), p), torch.arange(B), n_pages - 1 - i, fmt.code,
                     1.0, 1.0)
    bits[tail] = 0b10110111
    bt = torch.stack([tail.flip(0), tail]).int()
    bt[1, 4:] = -1
    q = torch.randn(2, 2, D, generator=g)
    args = (q, slot, group, k_group, bits, bt, fmt.code, 0.25, 1.0, 1.0, True)
    assert_same(paged_attention_cpu(*args), paged_attention_ref(*args))


def flushed_pool(fmt, H, D, num_pages, seed, offset_every=0):
    """A pool written the way engines write it: flush groups of 16 consecutive tokens in consecutive slots
    (full 16-token tiles of one key group, what the code-domain task is built for), every slot live but
    a few; ``offset_every`` shifts a flush group by 3 slots every that many groups (tiles that straddle
    groups and pages)."""
    g = torch.Generator().manual_seed(seed)
    slot = [torch.zeros((num_pages, B, *f.shape), dtype=f.dtype) for f in fmt.slot_fields(H, D)]
    n_slots = num_pages * B
    group = [torch.zeros((n_slots, *f.shape), dtype=f.dtype) for f in fmt.group_fields(H, D)]
    k_group = torch.full((num_pages, B), -1, dtype=torch.int32)
    offset = torch.randn(H, D, generator=g) * 3
    start, gid = 0, 0
    while start < n_slots:
        size = 13 if offset_every and gid % offset_every == offset_every - 1 else fmt.group_size
        idx = torch.arange(start, min(start + size, n_slots))
        k = torch.randn(len(idx), H, D, generator=g) * 2 + offset
        v = torch.randn(len(idx), H, D, generator=g)
        kv_write_ref(k, v, slot, group, k_group, idx // B, idx % B, gid, fmt.code, 0.7, 1.3)
        start, gid = start + len(idx), gid + 1
    bits = torch.full((num_pages,), (1 << B) - 1, dtype=torch.int32)
    bits[::5] = 0b11011111  # a few holes
    return slot, group, k_group, bits


def interleaved_pool(fmt, H, D, num_pages, groups, seed):
    """A pool whose slots alternate between ``groups`` key groups slot by slot (what in-place reuse leaves after
    many anneals): slot i belongs to group (7 i) mod ``groups``, so a task meets more groups than its cache of
    decoded group rows holds and ids that share an entry (g, g + 16, ...) follow each other."""
    g = torch.Generator().manual_seed(seed)
    slot = [torch.zeros((num_pages, B, *f.shape), dtype=f.dtype) for f in fmt.slot_fields(H, D)]
    group = [torch.zeros((groups, *f.shape), dtype=f.dtype) for f in fmt.group_fields(H, D)]
    k_group = torch.full((num_pages, B), -1, dtype=torch.int32)
    owner = (torch.arange(num_pages * B) * 7) % groups
    for gid in range(groups):
        idx = torch.nonzero(owner == gid).flatten()
        k = torch.randn(len(idx), H, D, generator=g) * (1 + gid % 5) + gid % 3
        v = torch.randn(len(idx), H, D, generator=g)
        kv_write_ref(k, v, slot, group, k_group, idx // B, idx % B, gid, fmt.code, 0.7, 1.3)
    bits = torch.full((num_pages,), (1 << B) - 1, dtype=torch.int32)
    bits[1::3] = 0b10110111  # holes
    return slot, group, k_group, bits


@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n].quantized])
def test_attention_interleaved_groups_match_reference(name):
    """Slots of 40 key groups interleaved (cache entries evicted and refilled mid-page), splits and logits."""
    fmt = FORMATS[name]
    pool = interleaved_pool(fmt, 3, 64, num_pages=20, groups=40, seed=5)
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4)) * 2
    bt = torch.stack([torch.arange(20), torch.arange(20).flip(0)]).int()
    for splits, logits in ((None, False), (3, True)):
        got, want = run_both(fmt, q, pool, bt, logits=logits, splits=splits)
        assert_same(got, want)


# (H, G, D): SmolLM2 (3, 3, 64), r1-llama-8b (8 KV heads, G=4, D=128) cut to 2 heads, and GQA widths whose
# query heads span several register chunks (G = 5..7: scores 4 at a time, P.V 4 (D=64) or 2 (D=128)).
CODE_SHAPES = [(3, 3, 64), (2, 4, 128), (1, 1, 64), (1, 5, 64), (2, 6, 128), (1, 7, 128), (1, 2, 64)]


@pytest.mark.parametrize("shape", CODE_SHAPES, ids=lambda s: "H{}G{}D{}".format(*s))
@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n].quantized])
def test_attention_flushed_groups_match_reference(name, shape):
    """Long rows of full 16-token tiles (and tiles cut by a group boundary), several splits, logits."""
    H, G, D = shape
    fmt = FORMATS[name]
    pool = flushed_pool(fmt, H, D, num_pages=24, seed=D + G, offset_every=4)
    q = torch.randn(3, H * G, D, generator=torch.Generator().manual_seed(3)) * 2
    bt = torch.stack([torch.arange(24), torch.arange(24).flip(0), torch.arange(24)]).int()
    bt[2, 15:] = -1
    for splits, logits in ((None, False), (3, True)):
        got, want = run_both(fmt, q, pool, bt, logits=logits, splits=splits)
        assert_same(got, want)


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4o", "ternary"])
def test_every_e4m3_key_scale_byte_decodes_as_the_reference(name):
    """All 256 E4M3 key-scale bytes (subnormals, -0, 448, and the NaN codes 0x7F / 0xFF) through the kernels'
    row decode (codecs.h, e4m3_row_to_float: F16C where the CPU has it), on pools whose key group changes
    slot by slot (make_pool) and on the code-domain task's flushed pools; a NaN score makes the row NaN, as
    in the reference's softmax, also when a whole split saw nothing else."""
    H, G, D = 2, 3, 64
    fmt = FORMATS[name]
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    q = torch.randn(3, H * G, D, generator=torch.Generator().manual_seed(4)) * 1e-3  # scores of order 1
    for pool, bt in ((on_cpu(make_pool(fmt, H, D, num_pages=6, seed=5)), make_table(3, 5, 6, seed=2).cpu()),
                     (flushed_pool(fmt, H, D, num_pages=24, seed=6, offset_every=4),
                      torch.stack([torch.arange(24)] * 3).int())):
        slot, group, k_group, bits = pool
        ks = group[0].view(-1)
        ks[:] = finite.repeat(ks.numel() // len(finite) + 1)[: ks.numel()]
        got, want = run_both(fmt, q, (slot, group, k_group, bits), bt)
        assert_same(got, want)
        ks[5], ks[ks.numel() // 2] = 0x7F, 0xFF
        got, want = run_both(fmt, q, (slot, group, k_group, bits), bt)
        assert any(torch.isnan(t).any() for t in want)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, atol=3e-5, rtol=3e-5, equal_nan=True)
        ks[:] = 0x7F  # every score NaN: each split ends with m = -inf and l = NaN, which the merge must keep
        for splits in (None, 2, 3):
            got, want = run_both(fmt, q, (slot, group, k_group, bits), bt, splits=splits)
            assert torch.isnan(want[0]).all()
            for a, e in zip(got, want):
                torch.testing.assert_close(a, e, atol=3e-5, rtol=3e-5, equal_nan=True)


# --- kv_write: byte-identical with the reference -------------------------------------------------
def check_write(name, k, v, pages, slots, gid, scales, seed=0):
    fmt = FORMATS[name]
    H, D = k.shape[1:]
    slot, group, kg = pools(fmt, H, D, seed)
    want = ([t.clone() for t in slot], [t.clone() for t in group], kg.clone())
    kv_write_ref(k, v, *want, pages, slots, gid, fmt.code, *scales)
    kv_write_cpu(k, v, slot, group, kg, pages, slots, gid, fmt.code, *scales)
    assert_bitwise([*want[0], *want[1], want[2]], [*slot, *group, kg])


@pytest.mark.parametrize("n", [1, 5, 16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_kv_write_random_bit_exact(name, n):
    H, D = 2, 32
    if not FORMATS[name].quantized:
        n = {1: 1, 5: 7, 16: 23}[n]
    k, v = tensors(name, n, H, D, seed=n)
    check_write(name, k, v, *scatter(n, seed=n), gid=n % 4, scales=(0.37, 1.7), seed=n)


@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n].quantized or n == "fp8"])
def test_kv_write_rounding_ties_bit_exact(name):
    n, H, D = 16 if FORMATS[name].quantized else 6, 1, 32
    k, v = tie_tensors(name, n, H, D)
    check_write(name, k, v, *scatter(n, seed=1), gid=3, scales=(1.0, 1.0))


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "ternaryo", "int2"])
def test_kv_write_saturating_scales_bit_exact(name):
    k, v = tensors(name, 6, 1, 16, seed=4)
    check_write(name, k * 100, v * 100, *scatter(6, seed=2), gid=0, scales=(1e-4, 3e-3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "fp8", "nvfp4o", "int4", "ternary"])
def test_kv_write_half_inputs_bit_exact(name, dtype):
    n = 9 if not FORMATS[name].quantized else 12
    k, v = tensors(name, n, 2, 64, seed=5)
    check_write(name, k.to(dtype), v.to(dtype), *scatter(n, seed=3), gid=1, scales=(0.5, 2.0))


def test_kv_write_special_values_bit_exact():
    """inf / huge / denormal inputs round and saturate as the reference does (fp16/bf16/fp8 casts)."""
    vals = torch.tensor([math.inf, -math.inf, 1e30, -7e4, 6.1e-5, 3e-8, -0.0, 65520.0, 448.1, 1e-39])
    k = vals[torch.arange(3 * 2 * 16) % len(vals)].view(3, 2, 16)
    for name in ("fp16", "bf16", "fp8"):
        check_write(name, k, k.flip(0), *scatter(3, seed=9), gid=-1, scales=(1.0, 1.0))


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "ternaryo"])
def test_kv_write_magnitude_sweep_bit_exact(name):
    """E4M3 scales and elements across every binade the encoders see: fp32 subnormals, E4M3 subnormals,
    the exact E4M3 midpoints (ties) and the saturation edge, with both signs (branch-free encoders)."""
    from plugins.formats.e4m3 import e4m3_decode

    grid = e4m3_decode(torch.arange(0, 127, dtype=torch.uint8)).float()
    mids = (grid[1:] + grid[:-1]) / 2
    mags = torch.cat([grid, mids, torch.logspace(-44, 3, 300, base=2.0), torch.tensor([1e-45, 3e-39, 447.9, 448.0,
                                                                                        464.0, 1e6])])
    vals = torch.cat([mags, -mags])
    n, H, D = 16, 1, 32
    reps = -(-len(vals) // (n * H * D))
    k = vals.repeat(reps)[: reps * n * H * D].view(reps, n, H, D)
    for j in range(reps):
        check_write(name, k[j], k[j].flip(0) * 0.37, *scatter(n, seed=j), gid=1, scales=(1.0, 1.0))


@pytest.mark.parametrize("n", [2, 13])  # G * n <= the test pools' 40 slots
@pytest.mark.parametrize("name", list(FORMATS))
def test_kv_write_groups_bit_exact(name, n):
    """G flush groups in one call equal ``kv_write_ref`` of each group in turn (distinct slots, any gids)."""
    G, H, D = 3, 2, 32
    fmt = FORMATS[name]
    k, v = tensors(name, G * n, H, D, seed=n)
    pages, slots = scatter(G * n, seed=n + 1)
    gids = torch.tensor([3, 0, 2]) if fmt.quantized else torch.full((G,), -1)
    slot, group, kg = pools(fmt, H, D, n)
    want = ([t.clone() for t in slot], [t.clone() for t in group], kg.clone())
    for j in range(G):
        kv_write_ref(k[j * n:(j + 1) * n], v[j * n:(j + 1) * n], *want, pages[j * n:(j + 1) * n],
                     slots[j * n:(j + 1) * n], int(gids[j]), fmt.code, 0.37, 1.7)
    kv_write_groups_cpu(k.view(G, n, H, D), v.view(G, n, H, D), slot, group, kg, pages.view(G, n), slots.view(G, n),
                        gids, fmt.code, 0.37, 1.7)
    assert_bitwise([*want[0], *want[1], want[2]], [*slot, *group, kg])
    slot2, group2, kg2 = pools(fmt, H, D, n)  # the reference of the batched op: the same loop
    kv_write_groups_ref(k.view(G, n, H, D), v.view(G, n, H, D), slot2, group2, kg2, pages.view(G, n),
                        slots.view(G, n), gids, fmt.code, 0.37, 1.7)
    assert_bitwise([*want[0], *want[1], want[2]], [*slot2, *group2, kg2])
    slot3, group3, kg3 = pools(fmt, H, D, n)  # the registered op (whatever backend the mode picks)
    torch.ops.trtkv.kv_write_groups(k.view(G, n, H, D), v.view(G, n, H, D), slot3, group3, kg3, pages.view(G, n),
                                    slots.view(G, n), gids, fmt.code, 0.37, 1.7)
    assert_bitwise([*want[0], *want[1], want[2]], [*slot3, *group3, kg3])


def test_kv_write_groups_shape_errors_are_one_line():
    fmt = FORMATS["nvfp4"]
    slot, group, kg = pools(fmt, 2, 32, 0)
    k = torch.randn(2, 4, 2, 32)
    with pytest.raises(RuntimeError, match="one entry per group"):
        kv_write_groups_cpu(k, k, slot, group, kg, torch.zeros(2, 4, dtype=torch.long),
                            torch.arange(8).view(2, 4), torch.tensor([0]), fmt.code, 1.0, 1.0)


# --- dispatch and fallback -----------------------------------------------------------------------
def test_ops_dispatch_to_cpu_kernels_by_default(monkeypatch):
    import plugins.cpu_kernels.ops as cops
    import plugins.ops as ops
    from plugins.backend import kernel_impl

    calls = []
    real_attn, real_write = cops.paged_attention_cpu, cops.kv_write_cpu
    monkeypatch.setattr(cops, "paged_attention_cpu", lambda *a: calls.append("attn") or real_attn(*a))
    monkeypatch.setattr(cops, "kv_write_cpu", lambda *a: calls.append("write") or real_write(*a))
    monkeypatch.setenv("TRTKV_KERNELS", "auto")
    fmt = FORMATS["int4"]
    slot, group, k_group, bits = on_cpu(make_pool(fmt, 1, 16, num_pages=2, seed=0))
    q = torch.randn(1, 2, 16)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    assert kernel_impl(q) == "cpu"
    out = ops.paged_attention(q, slot, group, k_group, bits, bt, fmt.code, 0.25, 1.0, 1.0, False, dense_run=(0, 3))
    ops.kv_write(q[:, :1].expand(3, 1, 16), q[:, 1:].expand(3, 1, 16), slot, group, k_group,
                 torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]), 0, fmt.code, 1.0, 1.0)
    assert calls == ["attn", "write"] and out[0].shape == (1, 2, 16)
    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    assert kernel_impl(q) == "reference"
    ops.paged_attention(q, slot, group, k_group, bits, bt, fmt.code, 0.25, 1.0, 1.0, False)
    assert calls == ["attn", "write"]


def test_unknown_kernel_mode_is_one_clear_error(monkeypatch):
    from plugins.backend import kernel_impl
    from trtkv.errors import TrtkvError

    monkeypatch.setenv("TRTKV_KERNELS", "fast")
    with pytest.raises(TrtkvError, match="TRTKV_KERNELS='fast' is not one of"):
        kernel_impl(torch.zeros(1))


def test_missing_compiler_falls_back_with_one_warning_line(tmp_path):
    """No C++ compiler for the first-use build (TRTKV_CPU_KERNELS_JIT=1: not the kernels built at install):
    one log line, then the reference runs (same numbers), exit 0 — never a crash."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, plugins.ops\n"
        "from plugins.backend import kernel_impl\n"
        "q = torch.randn(1, 2, 16); k = torch.randn(1, 8, 1, 16).half()\n"
        "out = torch.ops.trtkv.paged_attention(q, [k, k], [], torch.zeros(1, 8, dtype=torch.int32),\n"
        "    torch.tensor([255], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), 1, 0.25, 1.0, 1.0, False)\n"
        "torch.ops.trtkv.paged_attention(q, [k, k], [], torch.zeros(1, 8, dtype=torch.int32),\n"
        "    torch.tensor([255], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), 1, 0.25, 1.0, 1.0, False)\n"
        "print(kernel_impl(q), tuple(out[0].shape))\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), TRTKV_KERNEL_CACHE=str(tmp_path / "cache"),
               TRTKV_KERNELS="auto", TRTKV_CPU_KERNELS_JIT="1", PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "reference (1, 2, 16)"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CPU kernels could not be built" in lines[0], r.stderr


def test_kernel_mode_is_read_once_per_pinned_block(monkeypatch):
    """A decode step pins ``TRTKV_KERNELS`` (plugins.backend.pinned_mode): a change inside the block applies from
    the next block on; blocks nest; outside one the variable is read on every call."""
    from plugins import backend

    t = torch.zeros(1)
    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    with backend.pinned_mode():
        monkeypatch.setenv("TRTKV_KERNELS", "cpu")
        assert backend.kernel_impl(t) == "reference"
        with backend.pinned_mode():
            assert backend.kernel_impl(t) == "reference"
        assert backend.kernel_impl(t) == "reference"
    assert backend.kernel_impl(t) == ("cpu" if backend._cpu_build().cpu_kernels_available() else "reference")
    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    assert backend.kernel_impl(t) == "reference"


def test_a_dense_run_applies_to_the_first_source_only(monkeypatch):
    """``plugins.ops.paged_attention_formats`` off Triton: a lone request's dense page run (the reference then
    reads a view of the pool) is the first source's; a second source (host-tier pages staged beside them)
    is read through its own block table."""
    from plugins import ops
    from plugins.paged_attention.reference import PagedFormat, paged_attention_ref

    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    g = torch.Generator().manual_seed(0)
    B, H, D = 8, 2, 16
    srcs = []
    for pages in ([0, 1], [2, 3]):  # the second pool's pages are not at 0: a run read from it would be wrong
        k, v = (torch.randn(4, B, H, D, generator=g).half() for _ in range(2))
        bits = torch.full((4,), (1 << B) - 1, dtype=torch.int32)
        srcs.append(PagedFormat([k, v], [], torch.full((4, B), -1, dtype=torch.int32), bits,
                                torch.tensor([pages], dtype=torch.int32), 1, 1.0, 1.0))
    q = torch.randn(1, 4, D, generator=g)
    parts, _ = ops.paged_attention_formats(q, srcs, 0.25, False, dense_run=(0, 2 * B))
    for (out, lse), s in zip(parts, srcs):
        want = paged_attention_ref(q, s.slot_fields, [], s.k_group, s.valid_bits, s.block_table, 1, 0.25, 1.0, 1.0,
                                   False)
        torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)
