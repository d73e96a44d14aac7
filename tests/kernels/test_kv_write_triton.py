"""Triton kv_write must leave pools, arena and ``k_group`` byte-identical to the torch reference.

Besides random data the inputs hit the encoders' edge cases: all-zero groups (scale 0), negative
zeros (sign bits), exact rounding ties of every element grid, saturating scales, fp16/bf16 inputs.
"""
from __future__ import annotations

import os

import pytest
import torch

from plugins.formats import FORMATS
from plugins.kv_write.reference import kv_write_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before Python starts)",
)

B, PAGES, GROUPS = 8, 5, 4
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TIES = {  # |x / s_eff| at the grid's rounding midpoints, plus the group maximum that pins the scale
    "nvfp4": [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0],
    "ternary": [1.0, 0.5, 0.25],
    "int": [15.0, 0.5, 1.5, 2.5, 7.5, 14.5],
    "fp8": [1.0625, 1.1875, 1.5 * 2**-9, 2**-10, 7.5 * 2**-9, 464.0, 13.5 * 2**-3],  # E4M3 midpoints
}


def pools(fmt, H, D, seed):
    """Random stale bytes everywhere, so untouched slots are checked too."""
    g = torch.Generator().manual_seed(seed)

    def fill(shape, dtype):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype) if dtype == torch.uint8 \
            else torch.randn(shape, generator=g).to(dtype)

    slot = [fill((PAGES, B, *f.shape), f.dtype) for f in fmt.slot_fields(H, D)]
    group = [fill((GROUPS, *f.shape), f.dtype) for f in fmt.group_fields(H, D)]
    k_group = torch.randint(-1, GROUPS, (PAGES, B), generator=g, dtype=torch.int32)
    return slot, group, k_group


def tensors(name, n, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=g) * 4 + torch.randn(H, D, generator=g) * 3
    v = torch.randn(n, H, D, generator=g)
    k[:, 0, :16] = 0.0  # an all-zero key channel block and value group: scale 0
    v[0, -1, :16] = 0.0
    k[0, -1, 16:] = -0.0
    v[-1, 0, 16:32] = -1e-9  # rounds to zero: keeps only its sign bit
    return k, v


def tie_tensors(name, n, H, D):
    """Values landing exactly on rounding midpoints (scale 1 at unit layer scales)."""
    kind = "int" if name.startswith("int") else "ternary" if name.startswith("ternary") else name[:5]
    grid = TIES[kind]
    t = torch.tensor(grid)[torch.arange(n * H * D) % len(grid)].view(n, H, D)
    sign = torch.where(torch.arange(D) % 3 == 0, -1.0, 1.0)
    if kind == "fp8":
        return t * sign, -t
    if kind == "int":
        t[0] = 0.0  # per channel min 0 and max 15: scale exactly 1, zero 0
        t[1 % n] = 15.0
        v = t.clone()
        v[:, :, ::16] = 0.0  # each value group spans [0, 15]
        v[:, :, 1::16] = 15.0
        return t, v
    t[0] = grid[0]  # per-channel amax (keys) ...
    t[:, :, ::16] = grid[0]  # ... and per-group amax (values)
    return t * sign, (t * sign).flip(-1)


def assert_bitwise(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{x.dtype}{tuple(x.shape)} differs"


def check(name, k, v, pages, slots, gid, scales, seed=0):
    from plugins.kv_write.triton_kernel import kv_write_triton

    fmt = FORMATS[name]
    H, D = k.shape[1:]
    slot, group, kg = pools(fmt, H, D, seed)
    want = ([t.clone() for t in slot], [t.clone() for t in group], kg.clone())
    kv_write_ref(k, v, *want, pages, slots, gid, fmt.code, *scales)
    got = [t.to(DEV) for t in slot], [t.to(DEV) for t in group], kg.to(DEV)
    kv_write_triton(k.to(DEV), v.to(DEV), *got, pages.to(DEV), slots.to(DEV), gid, fmt.code, *scales)
    assert_bitwise([*want[0], *want[1], want[2]], [t.cpu() for t in [*got[0], *got[1], got[2]]])


def scatter(n, seed):
    perm = torch.randperm(PAGES * B, generator=torch.Generator().manual_seed(seed))[:n]
    return (perm // B).int(), (perm % B).int()


@pytest.mark.parametrize("n", [1, 5, 16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_random_group_bit_exact(name, n):
    H, D = 2, 32
    if not FORMATS[name].quantized:
        n = {1: 1, 5: 7, 16: 23}[n]  # write-through: tokens of several sequences in one call
    k, v = tensors(name, n, H, D, seed=n)
    check(name, k, v, *scatter(n, seed=n), gid=n % GROUPS, scales=(0.37, 1.7), seed=n)


@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n].quantized or n == "fp8"])
def test_rounding_ties_bit_exact(name):
    n, H, D = 16 if FORMATS[name].quantized else 6, 1, 32
    k, v = tie_tensors(name, n, H, D)
    check(name, k, v, *scatter(n, seed=1), gid=3, scales=(1.0, 1.0))


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "ternaryo"])
def test_saturating_scales_bit_exact(name):
    """Tiny layer scales push E4M3 scales (or fp8 elements) past 448: both must clip the same way."""
    k, v = tensors(name, 6, 1, 16, seed=4)
    check(name, k * 100, v * 100, *scatter(6, seed=2), gid=0, scales=(1e-4, 3e-3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "fp8", "nvfp4o", "int4"])
def test_half_inputs_bit_exact(name, dtype):
    n = 9 if not FORMATS[name].quantized else 12
    k, v = tensors(name, n, 2, 64, seed=5)
    check(name, k.to(dtype), v.to(dtype), *scatter(n, seed=3), gid=1, scales=(0.5, 2.0))


def test_op_dispatches_to_triton(monkeypatch):
    import plugins.ops  # noqa: F401
    import plugins.kv_write.triton_kernel as tk

    calls = []
    real = tk.kv_write_triton
    monkeypatch.setattr(tk, "kv_write_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("TRTKV_KERNELS", "triton")
    fmt = FORMATS["nvfp4"]
    slot, group, kg = pools(fmt, 1, 16, 0)
    slot, group, kg = [t.to(DEV) for t in slot], [t.to(DEV) for t in group], kg.to(DEV)
    k = torch.randn(3, 1, 16, device=DEV)
    pages, slots = (t.to(DEV) for t in scatter(3, 0))
    torch.ops.trtkv.kv_write(k, k, slot, group, kg, pages, slots, 2, fmt.code, 1.0, 1.0)
    assert calls and torch.all(kg[pages.long(), slots.long()] == 2)


@pytest.mark.parametrize("n", [3, 16])
@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8", "nvfp4", "ternaryo", "int4", "int2"])
def test_groups_in_one_launch_bit_exact(name, n):
    """``kv_write_groups_triton``: G groups in one launch equal ``kv_write_ref`` of each group in turn (their own
    arena entries, slots anywhere in the pool)."""
    from plugins.kv_write.triton_kernel import kv_write_groups_triton

    G, H, D = 2, 2, 32
    fmt = FORMATS[name]
    k, v = tensors(name, G * n, H, D, seed=n)
    pages, slots = scatter(G * n, seed=n + 1)
    gids = torch.tensor([3, 1]) if fmt.quantized else torch.full((G,), -1)
    slot, group, kg = pools(fmt, H, D, n)
    want = ([t.clone() for t in slot], [t.clone() for t in group], kg.clone())
    for j in range(G):
        s = slice(j * n, (j + 1) * n)
        kv_write_ref(k[s], v[s], *want, pages[s], slots[s], int(gids[j]), fmt.code, 0.37, 1.7)
    slot, group, kg = [t.to(DEV) for t in slot], [t.to(DEV) for t in group], kg.to(DEV)
    kv_write_groups_triton(k.view(G, n, H, D).to(DEV), v.view(G, n, H, D).to(DEV), slot, group, kg,
                           pages.view(G, n).to(DEV), slots.view(G, n).to(DEV), gids, fmt.code, 0.37, 1.7)
    assert_bitwise([*want[0], *want[1], want[2]], [t.cpu() for t in [*slot, *group, kg]])
