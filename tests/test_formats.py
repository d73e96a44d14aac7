"""Quantized KV formats: exact bit layouts (the kernels' contract), error bounds and group axes (spec §9.6-9.8)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from plugins.formats import FORMATS, LayerScales, format_by_code, get_format
from plugins.formats.e4m3 import e4m3_decode, e4m3_encode
from plugins.formats.nvfp4 import e2m1_decode, e2m1_encode
from plugins.formats.packing import pack, per_channel, unpack
from plugins.formats.quantized import calibrate_layer_scales, count_saturated
from plugins.formats.ternary import ternary_decode

torch.set_num_threads(1)
FAST = settings(max_examples=60, deadline=None)
QUANT = ["fp8", "nvfp4", "ternary", "int4", "int2", "nvfp4o", "ternaryo"]
GROUPED = [n for n in QUANT if n != "fp8"]
BLOCK = ["nvfp4", "ternary", "nvfp4o", "ternaryo"]
U8, F16 = torch.uint8, torch.float16
ONE = LayerScales()


def u8(*xs):
    return torch.tensor(xs, dtype=U8)


def enc(name, k, v, scales=ONE):
    return get_format(name).encode(k, v, scales)


# --------------------------------------------------------------------------------------------
# registry and layout contract
# --------------------------------------------------------------------------------------------
def test_registry_layouts():
    H, D = 2, 32
    expect = {
        "fp8": (3, 1, 8, [("k", (H, D), U8), ("v", (H, D), U8)], []),
        "nvfp4": (4, 16, 4, [("k", (H, 16), U8), ("v", (H, 16), U8), ("v_scale", (H, 2), U8)], [("k_scale", (H, D), U8)]),
        "ternary": (5, 16, 2, [("k", (H, 8), U8), ("v", (H, 8), U8), ("v_scale", (H, 2), U8)], [("k_scale", (H, D), U8)]),
        "int4": (6, 16, 4, [("k", (H, 16), U8), ("v", (H, 16), U8), ("v_scale", (H, 2), F16), ("v_zero", (H, 2), F16)],
                 [("k_scale", (H, D), F16), ("k_zero", (H, D), F16)]),
        "int2": (7, 16, 2, [("k", (H, 8), U8), ("v", (H, 8), U8), ("v_scale", (H, 2), F16), ("v_zero", (H, 2), F16)],
                 [("k_scale", (H, D), F16), ("k_zero", (H, D), F16)]),
        "nvfp4o": (8, 16, 4, [("k", (H, 16), U8), ("v", (H, 16), U8), ("v_scale", (H, 2), U8)],
                   [("k_scale", (H, D), U8), ("k_offset", (H, D), F16)]),
        "ternaryo": (9, 16, 2, [("k", (H, 8), U8), ("v", (H, 8), U8), ("v_scale", (H, 2), U8)],
                     [("k_scale", (H, D), U8), ("k_offset", (H, D), F16)]),
    }
    for name, (code, g, bits, slot, group) in expect.items():
        f = get_format(name)
        assert f is format_by_code(code) and f.group_size == g and f.element_bits == bits and f.description
        assert [(s.name, s.shape, s.dtype) for s in f.slot_fields(H, D)] == slot
        assert [(s.name, s.shape, s.dtype) for s in f.group_fields(H, D)] == group


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("H,D,n", [(1, 16, 16), (2, 64, 5), (4, 128, 1)])
def test_byte_sizes_match_encoded_fields(name, H, D, n):
    f = get_format(name)
    slot, group = f.encode(torch.randn(n, H, D), torch.randn(n, H, D), ONE)
    assert [s.name for s in f.slot_fields(H, D)] == list(slot)
    assert [s.name for s in f.group_fields(H, D)] == list(group)
    for s in f.slot_fields(H, D):
        assert slot[s.name].shape == (n, *s.shape) and slot[s.name].dtype == s.dtype
    for s in f.group_fields(H, D):
        assert group[s.name].shape == s.shape and group[s.name].dtype == s.dtype
    assert f.slot_bytes(H, D) == sum(t[0].numel() * t.element_size() for t in slot.values())
    assert f.group_bytes(H, D) == sum(t.numel() * t.element_size() for t in group.values())


@pytest.mark.parametrize("name,bits", [("nvfp4", 4.5), ("ternary", 2.5), ("fp8", 8.0)])
def test_storage_cost_per_element(name, bits):  # spec §3.5, scales amortized over the flush group
    f, H, D = get_format(name), 8, 128
    per_token = f.slot_bytes(H, D) + f.group_bytes(H, D) / f.group_size
    assert per_token * 8 / (2 * H * D) == bits


# --------------------------------------------------------------------------------------------
# E4M3 / E2M1 / ternary element codecs
# --------------------------------------------------------------------------------------------
def test_e4m3_golden():
    x = torch.tensor([1.0, -2.0, 448.0, 500.0, -1e9, 2.0**-9, 2.0**-6, 7 * 2.0**-9, 1.125, 1.0625, 1.1875, 15.5,
                      3.0, 0.0, -0.0, float("inf"), float("nan"), -2.0**-11])
    assert e4m3_encode(x).tolist() == [0x38, 0xC0, 0x7E, 0x7E, 0xFE, 0x01, 0x08, 0x07, 0x39, 0x38, 0x3A, 0x58,
                                       0x44, 0x00, 0x80, 0x7E, 0x00, 0x80]
    up = torch.tensor([1.0, 1.0001, 1.126, 449.0, 2.0**-12, 0.0, 15.01, 2.0**-9 + 2.0**-20])
    assert e4m3_encode(up, round_up=True).tolist() == [0x38, 0x39, 0x3A, 0x7E, 0x01, 0x00, 0x58, 0x02]
    assert e4m3_decode(u8(0x38, 0xC0, 0x7E, 0x01, 0x08, 0x44, 0x80)).tolist() == [1, -2, 448, 2.0**-9, 2.0**-6, 3, 0]
    assert math.isnan(e4m3_decode(u8(0x7F)).item()) and math.isnan(e4m3_decode(u8(0xFF)).item())


def test_e4m3_matches_torch_cast_and_all_patterns():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-14, 11, (20000,), generator=g).float())
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(U8)
    assert torch.equal(e4m3_encode(x), ref)
    allb = torch.arange(256, dtype=U8)
    finite = (allb & 0x7F) != 0x7F
    dec = e4m3_decode(allb)
    assert torch.equal(dec[finite], allb.view(torch.float8_e4m3fn).float()[finite])
    assert torch.equal(e4m3_encode(dec[finite]), allb[finite])
    assert torch.equal(e4m3_encode(dec[finite], round_up=True)[:0x7F], allb[:0x7F])


@FAST
@given(st.lists(st.floats(0, 1000, allow_subnormal=False, width=32), min_size=1, max_size=64))
def test_e4m3_round_up_is_smallest_upper_bound(xs):
    x = torch.tensor(xs)
    up = e4m3_decode(e4m3_encode(x, round_up=True))
    grid = e4m3_decode(torch.arange(0x7F, dtype=U8))  # all non-negative finite values, ascending
    want = grid[torch.searchsorted(grid, x.clamp(max=448))]
    assert torch.equal(up, want)
    assert (up >= x.clamp(max=448)).all()


def test_e2m1_golden():
    mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert e2m1_decode(torch.arange(16)).tolist() == mags + [-m for m in mags]
    r = torch.tensor([0.25, 0.26, 0.75, 0.74, 1.25, 1.26, 1.75, 2.5, 2.51, 3.5, 5.0, 5.01, 7.0, -0.1, -0.0, -5.0])
    assert e2m1_encode(r).tolist() == [0, 1, 2, 1, 2, 3, 4, 4, 5, 6, 6, 7, 7, 8, 8, 14]


def test_ternary_crumbs_and_minus_zero():
    assert ternary_decode(torch.tensor([0b00, 0b01, 0b11, 0b10])).tolist() == [0, 1, -1, 0]
    slot = {"k": u8(0x26).expand(1, 1, 4), "v": u8(0xAA).expand(1, 1, 4), "v_scale": u8(0x38).expand(1, 1, 1)}
    k, v = get_format("ternary").decode(slot, {"k_scale": torch.full((1, 1, 16), 0x38, dtype=U8)}, ONE)
    assert k[0, 0, :4].tolist() == [0, 1, 0, 0] and not v.any()  # 0x26 = 00 10 01 10; 0xAA is all "-0"


@FAST
@given(st.sampled_from([2, 4]), st.lists(st.integers(1, 3), max_size=3), st.sampled_from([16, 32]), st.integers(0, 2**31 - 1))
def test_pack_roundtrip(bits, lead, D, seed):
    codes = torch.randint(0, 1 << bits, (*lead, D), generator=torch.Generator().manual_seed(seed))
    packed = pack(codes, bits)
    assert packed.shape == (*lead, D * bits // 8) and packed.dtype == U8
    assert torch.equal(unpack(packed, bits), codes.int())


# --------------------------------------------------------------------------------------------
# golden encodes: every nibble/crumb position, byte by byte
# --------------------------------------------------------------------------------------------
NV_ROW = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0.25]
NV_BYTES = [0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x0F]


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4o"])
def test_nvfp4_golden(name):
    k = torch.tensor([NV_ROW, [6.0] * 16]).view(2, 1, 16)  # every channel's amax is 6 -> scale 1.0 (0x38)
    if name == "nvfp4o":  # shift channels so the midpoint is the offset; residual -3 / +3 -> scale 0.5
        k = torch.tensor([[10.0] * 16, [16.0] * 16]).view(2, 1, 16) + torch.arange(16.0) * 4
    v = torch.tensor([NV_ROW, [7.0, 1.0] + [0.0] * 14]).view(2, 1, 16)
    slot, group = enc(name, k, v)
    assert slot["v"].tolist() == [[NV_BYTES], [[0x27] + [0] * 7]]  # 7/1.25 = 5.6 -> 6 (code 7); 0.8 -> 1 (code 2)
    assert slot["v_scale"].tolist() == [[[0x38]], [[0x3A]]]  # 7/6 rounds up to 1.25
    if name == "nvfp4":
        assert slot["k"].tolist() == [[NV_BYTES], [[0x77] * 8]] and group["k_scale"].tolist() == [[0x38] * 16]
    else:
        assert slot["k"].tolist() == [[[0xFF] * 8], [[0x77] * 8]] and group["k_scale"].tolist() == [[0x30] * 16]
        assert group["k_offset"].tolist() == [(13 + 4 * torch.arange(16.0)).tolist()]
    kd, vd = get_format(name).decode(slot, group, ONE)
    k_want = k.clone()
    k_want[0, 0, 15] = 0.0 if name == "nvfp4" else k_want[0, 0, 15]  # 0.25 is a tie: rounds to even code 0
    assert torch.equal(kd, k_want) and vd[0].flatten().tolist() == NV_ROW[:15] + [0] and vd[1, 0, :2].tolist() == [7.5, 1.25]
    # the global scale divides first: amax 6 with s_glob 0.5 -> s_fp8 = 2 (0x40), same element codes
    slot2, _ = enc(name, k, v, LayerScales(1.0, 0.5))
    assert slot2["v_scale"][0].tolist() == [[0x40]] and slot2["v"][0].tolist() == [NV_BYTES]


TERN_V = [1, 0.4, -0.4, 0.5, 0, 0.9, -0.5, 0.1, 0, 0, 0.6, 0, 0, 0, 0, 0.51,
          -1, 0, 0, 0, 0, -0.7, 0, 0, 0, 0, -0.6, 0, 0, 0, 0, -1]
TERN_BYTES = [0x01, 0x04, 0x10, 0x40, 0x03, 0x0C, 0x30, 0xC0]


@pytest.mark.parametrize("name", ["ternary", "ternaryo"])
def test_ternary_golden(name):
    v = torch.tensor(TERN_V).view(1, 1, 32)
    if name == "ternary":  # token 1 is all ones, so every channel's amax is 1
        k = torch.stack([v[0], torch.ones(1, 32)])
    else:  # offset 13 per channel, residual -3 / +3
        k = torch.stack([torch.full((1, 32), 10.0), torch.full((1, 32), 16.0)])
    slot, group = enc(name, k, v)
    assert slot["v"].tolist() == [[TERN_BYTES]] and slot["v_scale"].tolist() == [[[0x38, 0x38]]]
    if name == "ternary":
        assert slot["k"][0].tolist() == [TERN_BYTES] and slot["k"][1].tolist() == [[0x55] * 8]
        assert group["k_scale"].tolist() == [[0x38] * 32]
    else:  # s_fp8 = 3 (0x44); token 0 all -1 (11), token 1 all +1 (01)
        assert slot["k"].tolist() == [[[0xFF] * 8], [[0x55] * 8]] and group["k_scale"].tolist() == [[0x44] * 32]
        assert group["k_offset"].tolist() == [[13.0] * 32]
    kd, vd = get_format(name).decode(slot, group, ONE)
    assert torch.equal(vd, torch.round(v))  # half to even: +-0.5 -> 0
    if name == "ternaryo":
        assert torch.equal(kd, k)


def test_fp8_golden():
    k = torch.tensor([1.0, -2.0, 448.0, 500.0, 2.0**-9, 1.0625, -0.0, 3.0]).view(1, 1, 8).repeat(1, 1, 2)
    slot, group = enc("fp8", k, 2 * k, LayerScales(1.0, 2.0))
    want = [0x38, 0xC0, 0x7E, 0x7E, 0x01, 0x38, 0x80, 0x44] * 2
    assert group == {} and slot["k"].flatten().tolist() == want and slot["v"].flatten().tolist() == want
    kd, vd = get_format("fp8").decode(slot, group, LayerScales(1.0, 2.0))
    assert kd.flatten()[:8].tolist() == [1, -2, 448, 448, 2.0**-9, 1, 0, 3] and torch.equal(vd, 2 * kd)


def test_int_golden():
    t = torch.arange(16.0)
    k4 = (t.view(16, 1, 1) + t.view(1, 1, 16))  # channel d spans d..d+15: scale 1, zero d, code = token
    v4 = t.view(1, 1, 16)
    slot, group = enc("int4", k4, v4)
    assert slot["k"][:, 0].tolist() == [[0x11 * i] * 8 for i in range(16)]
    assert slot["v"].flatten().tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert group["k_scale"].tolist() == [[1.0] * 16] and group["k_zero"].tolist() == [t.tolist()]
    assert slot["v_scale"].flatten().tolist() == [1.0] and slot["v_zero"].flatten().tolist() == [0.0]
    kd, vd = get_format("int4").decode(slot, group, ONE)
    assert torch.equal(kd, k4) and torch.equal(vd, v4)

    k2 = (torch.arange(4.0) * 0.5 - 1).view(4, 1, 1).expand(4, 1, 16)  # min -1, max 0.5: scale 0.5, code = token
    v2 = torch.tensor([0.0, 1, 2, 3] * 4).view(1, 1, 16)
    slot, group = enc("int2", k2, v2)
    assert slot["k"][:, 0].tolist() == [[0x55 * i] * 4 for i in range(4)]
    assert slot["v"].flatten().tolist() == [0xE4] * 4  # 00 01 10 11 from bit 0 up
    assert group["k_scale"].unique().tolist() == [0.5] and group["k_zero"].unique().tolist() == [-1.0]
    kd, vd = get_format("int2").decode(slot, group, ONE)
    assert torch.equal(kd, k2) and torch.equal(vd, v2)


# --------------------------------------------------------------------------------------------
# error bounds (spec §9.7) on random groups
# --------------------------------------------------------------------------------------------
def _data(seed, n, H, D, mag_exp, offset):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=g) * 2.0**mag_exp
    k += torch.randn(1, H, D, generator=g) * offset * 2.0**mag_exp  # per-channel key offsets
    v = torch.randn(n, H, D, generator=g) * 2.0**mag_exp * torch.rand(n, H, D, generator=g)
    return k, v


def _s_eff(name, slot, group, scales):
    sk = e4m3_decode(group["k_scale"]) * torch.tensor(scales.k, dtype=torch.float32)
    sv = per_channel(e4m3_decode(slot["v_scale"])) * torch.tensor(scales.v, dtype=torch.float32)
    return sk, sv


case = st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 16), st.integers(1, 2), st.sampled_from([16, 32]),
                 st.integers(-6, 6), st.sampled_from([0.0, 8.0]), st.booleans())


@pytest.mark.parametrize("name", BLOCK)
@FAST
@given(c=case)
def test_block_error_bounds(name, c):
    seed, n, H, D, e, off, calib = c
    k, v = _data(seed, n, H, D, e, off)
    f = get_format(name)
    scales = calibrate_layer_scales(k.abs().max().item(), v.abs().max().item(), f) if calib else ONE
    slot, group = f.encode(k, v, scales)
    kd, vd = f.decode(slot, group, scales)
    kr = k - group["k_offset"].float() if "k_offset" in group else k
    sk, sv = _s_eff(name, slot, group, scales)
    qmax = 6.0 if name.startswith("nvfp4") else 1.0
    sat = count_saturated(f, k, v, scales)
    assert sat == (0, 0) or not calib  # calibrated scales never saturate on the calibration data
    assume(sat == (0, 0))  # the bounds below assume an unsaturated scale (spec §9.7)
    for x, xr, xd, s in ((k, kr, kd, sk), (v, v, vd, sv)):
        assert (xr.abs() <= qmax * s * (1 + 2**-20)).all()  # scale rounded up: nothing clipped
        slack = 2**-20 * (x.abs() + s)
        if qmax == 6.0:
            assert ((x - xd).abs() <= torch.maximum(s / 4, xr.abs() / 4) + slack).all()
        else:
            assert ((x - xd).abs() <= s / 2 + slack).all()


@FAST
@given(c=case)
def test_fp8_error_bounds(c):
    seed, n, H, D, e, _, calib = c
    k, v = _data(seed, n, H, D, e, 0.0)
    f = get_format("fp8")
    scales = calibrate_layer_scales(k.abs().max().item(), v.abs().max().item(), f) if calib else LayerScales(0.5, 2.0)
    kd, vd = f.decode(*f.encode(k, v, scales), scales)
    for x, xd, s in ((k, kd, scales.k), (v, vd, scales.v)):
        r = (x / s).abs()
        normal = (r >= 2**-6) & (r <= 448)
        err = (x - xd).abs()
        assert (err[normal] <= 2**-4 * x.abs()[normal] * (1 + 1e-6)).all()
        assert (err[r < 2**-6] <= 2**-10 * s * (1 + 1e-6)).all()


@pytest.mark.parametrize("name", ["int4", "int2"])
@FAST
@given(c=case)
def test_int_error_bounds(name, c):
    seed, n, H, D, e, off, _ = c
    k, v = _data(seed, n, H, D, e, off)
    f = get_format(name)
    slot, group = f.encode(k, v, ONE)
    kd, vd = f.decode(slot, group, ONE)
    sk, sv = group["k_scale"].float(), per_channel(slot["v_scale"].float())
    for x, xd, s, dim in ((k, kd, sk, 0), (v, vd, sv, None)):
        if dim == 0:
            lo, hi = x.amin(0), x.amax(0)
        else:
            g = x.reshape(n, H, D // 16, 16)
            lo, hi = per_channel(g.amin(-1)), per_channel(g.amax(-1))
        slack = 2**-10 * (hi.abs() + 2 * lo.abs()) + 1e-6  # fp16 rounding of scale and zero
        assert ((x - xd).abs() <= s / 2 + slack).all()


# --------------------------------------------------------------------------------------------
# exactly representable grids reconstruct exactly
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", QUANT)
@FAST
@given(st.integers(0, 2**31 - 1), st.integers(2, 16), st.integers(-5, 5), st.integers(-3, 3))
def test_exact_grid(name, seed, n, p, q):
    g = torch.Generator().manual_seed(seed)
    H, D = 2, 32
    s_glob = 2.0**q
    scales = LayerScales(s_glob, s_glob)
    sign = lambda shape: torch.randint(0, 2, shape, generator=g).float() * 2 - 1  # noqa: E731

    if name in ("fp8",):
        grid = e4m3_decode(torch.randint(0, 0x7F, (2, n, H, D), generator=g, dtype=U8)) * sign((2, n, H, D))
        k, v = grid * s_glob
    elif name.startswith(("nvfp4", "ternary")):
        vals = e2m1_decode(torch.arange(8)) if name.startswith("nvfp4") else torch.tensor([0.0, 1.0])
        top = vals[-1]
        idx = torch.randint(0, len(vals), (2, n, H, D), generator=g)
        k, v = vals[idx] * sign((2, n, H, D)) * 2.0**p * s_glob
        k[0], k[1] = top * 2.0**p * s_glob, -top * 2.0**p * s_glob  # every key channel hits +-amax
        v[..., ::16] = top * 2.0**p * s_glob  # every value group hits amax
        if name.endswith("o"):
            k = k + (torch.randint(-64, 64, (H, D), generator=g).float() * 2.0**p)  # fp16-exact offsets
    else:
        levels = 15 if name == "int4" else 3
        zero = torch.randint(-64, 64, (2, 1, H, D), generator=g).float() * 2.0**p
        codes = torch.randint(0, levels + 1, (2, n, H, D), generator=g).float()
        codes[0, 0], codes[0, 1] = 0, levels
        codes[1, :, :, ::16], codes[1, :, :, 1::16] = 0, levels
        zero[1] = per_channel(torch.randint(-64, 64, (H, D // 16), generator=g).float() * 2.0**p)
        k, v = codes * 2.0**p + zero
        scales = ONE
    f = get_format(name)
    kd, vd = f.decode(*f.encode(k, v, scales), scales)
    assert torch.equal(kd, k) and torch.equal(vd, v)


# --------------------------------------------------------------------------------------------
# group axes (spec §9.8), zeros, partial groups, leading dims
# --------------------------------------------------------------------------------------------
def _changed(a: dict, b: dict) -> dict:
    return {n: (a[n] != b[n]) for n in a}


@pytest.mark.parametrize("name", QUANT)
def test_group_axes(name):
    f, n, H, D = get_format(name), 16, 2, 32
    k, v = _data(3, n, H, D, 0, 2.0)
    s0, g0 = f.encode(k, v, ONE)
    k0, v0 = f.decode(s0, g0, ONE)
    t, h, d = 5, 1, 19
    slot_scale = [s for s in s0 if s not in ("k", "v")]

    # one element: only its key channel's group params and its token's value group params move
    k1, v1 = k.clone(), v.clone()
    k1[t, h, d] = v1[t, h, d] = 50.0
    s1, g1 = f.encode(k1, v1, ONE)
    kd, vd = f.decode(s1, g1, ONE)
    key_mask = torch.zeros(n, H, D, dtype=torch.bool)
    key_mask[:, h, d] = True if f.quantized else False
    key_mask[t, h, d] = True
    val_mask = torch.zeros(n, H, D, dtype=torch.bool)
    val_mask[t, h, (d // 16) * 16:(d // 16 + 1) * 16] = True if f.quantized else False
    val_mask[t, h, d] = True
    assert torch.equal(kd[~key_mask], k0[~key_mask]) and torch.equal(vd[~val_mask], v0[~val_mask])
    for name_, ch in _changed(g0, g1).items():
        assert ch.nonzero().tolist() in ([], [[h, d]])
    assert g0 == {} or _changed(g0, g1)[next(iter(g0))][h, d]  # the key scale did change
    for name_ in slot_scale:
        assert _changed(s0, s1)[name_].nonzero().tolist() in ([], [[t, h, d // 16]])
    assert not slot_scale or _changed(s0, s1)[slot_scale[0]][t, h, d // 16]

    if not f.quantized:
        return
    # one whole token: value scales of that token only
    k2, v2 = k.clone(), v.clone()
    k2[t] *= 10
    v2[t] *= 10
    s2, g2 = f.encode(k2, v2, ONE)
    for name_ in slot_scale:
        rows = _changed(s0, s2)[name_].nonzero()[:, 0].unique().tolist()
        assert rows == [t]
    assert any(ch.any() for ch in _changed(g0, g2).values())
    # one whole channel: key params of that channel only; one value group per token
    k3, v3 = k.clone(), v.clone()
    k3[:, h, d] *= 10
    v3[:, h, d] *= 10
    s3, g3 = f.encode(k3, v3, ONE)
    for ch in _changed(g0, g3).values():
        assert ch.nonzero().tolist() in ([], [[h, d]])
    for name_ in slot_scale:
        idx = _changed(s0, s3)[name_].nonzero()
        assert (idx[:, 1:] == torch.tensor([h, d // 16])).all()


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("n", [1, 7, 16])
def test_all_zero_group(name, n):
    f = get_format(name)
    z = torch.zeros(n, 2, 32)
    slot, group = f.encode(z, z, LayerScales(0.3, 3.0))
    assert all(not t.any() for t in (*slot.values(), *group.values()))
    k, v = f.decode(slot, group, LayerScales(0.3, 3.0))
    assert not k.any() and not v.any() and k.shape == v.shape == (n, 2, 32)


@pytest.mark.parametrize("name", GROUPED)
def test_partial_group_uses_its_own_tokens(name):
    f = get_format(name)
    k, v = _data(7, 16, 2, 32, 0, 1.0)
    k[5:] *= 100  # later tokens must not influence a 5-token group's key statistics
    s5, g5 = f.encode(k[:5], v[:5], ONE)
    s16, g16 = f.encode(k, v, ONE)
    assert not torch.equal(g5["k_scale"], g16["k_scale"])
    assert all(torch.equal(s5[x], s16[x][:5]) for x in s5 if x.startswith("v"))  # values are per token
    k5, _ = f.decode(s5, {x: t.expand(5, *t.shape) for x, t in g5.items()}, ONE)
    k16, _ = f.decode(s16, {x: t.expand(16, *t.shape) for x, t in g16.items()}, ONE)
    assert (k5 - k[:5]).abs().max() <= 0.6 * k[:5].abs().max()
    assert (k5 - k[:5]).abs().mean() < (k16[:5] - k[:5]).abs().mean()
    if "k_zero" in g5:
        assert torch.equal(g5["k_zero"], k[:5].amin(0).half())
    elif "k_offset" not in g5:
        qmax = 6.0 if name == "nvfp4" else 1.0
        assert torch.equal(g5["k_scale"], e4m3_encode(k[:5].abs().amax(0) / qmax, round_up=True))


@pytest.mark.parametrize("name", QUANT)
def test_decode_leading_dims(name):
    f, n = get_format(name), 8
    k, v = _data(11, n, 2, 32, 1, 1.0)
    scales = LayerScales(0.7, 1.3)
    slot, group = f.encode(k, v, scales)
    gathered = {x: t.expand(n, *t.shape) for x, t in group.items()}
    kf, vf = f.decode(slot, gathered, scales)
    assert kf.dtype == vf.dtype == torch.float32 and kf.shape == (n, 2, 32)
    lead = lambda t: t.reshape(2, 4, *t.shape[1:]).unsqueeze(0).expand(3, 2, 4, *t.shape[1:])  # noqa: E731
    kl, vl = f.decode({x: lead(t) for x, t in slot.items()}, {x: lead(t) for x, t in gathered.items()}, scales)
    assert kl.shape == (3, 2, 4, 2, 32) and torch.equal(kl[1].reshape(n, 2, 32), kf) and torch.equal(vl[2].reshape(n, 2, 32), vf)


# --------------------------------------------------------------------------------------------
# offsets, saturation, calibration, pool round trip
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plain,offset", [("nvfp4", "nvfp4o"), ("ternary", "ternaryo"), ("nvfp4", "int4")])
def test_offset_formats_win_on_offset_keys(plain, offset):
    k, v = _data(5, 16, 2, 64, 0, 20.0)  # |per-channel offset| ~ 20x the spread
    err = {}
    for name in (plain, offset):
        f = get_format(name)
        kd, _ = f.decode(*f.encode(k, v, ONE), ONE)
        err[name] = (kd - k).pow(2).mean().item()
    assert err[offset] < err[plain] / 10


@pytest.mark.parametrize("name,qmax", [("nvfp4", 6.0), ("ternary", 1.0)])
def test_scale_saturation_counted_and_clipped(name, qmax):
    f = get_format(name)
    k = torch.full((16, 1, 16), 1.0)
    k[3, 0, 2] = 448 * qmax * 4  # one key channel, one value group overflow the E4M3 scale at s_glob 1
    slot, group = f.encode(k, k, ONE)
    assert count_saturated(f, k, k, ONE) == (1, 1)
    assert group["k_scale"][0, 2] == 0x7E and slot["v_scale"][3, 0, 0] == 0x7E
    kd, vd = f.decode(slot, group, ONE)
    assert kd.max() == vd.max() == 448 * qmax
    assert count_saturated(get_format("fp8"), k, k, ONE) == (1, 1)
    assert count_saturated(get_format("int4"), k, k, ONE) == (0, 0)


def test_calibrate_layer_scales():
    def close(s, k, v):
        return s.k == pytest.approx(k, rel=1e-5) and s.v == pytest.approx(v, rel=1e-5)

    assert close(calibrate_layer_scales(6 * 448.0, 12 * 448.0, get_format("nvfp4")), 1.0, 2.0)
    assert close(calibrate_layer_scales(6 * 448.0, 12 * 448.0, get_format("nvfp4o")), 1.0, 2.0)
    assert close(calibrate_layer_scales(448.0, 896.0, get_format("ternary")), 1.0, 2.0)
    assert close(calibrate_layer_scales(224.0, 448.0, get_format("fp8")), 0.5, 1.0)
    assert calibrate_layer_scales(5.0, 5.0, get_format("int4")) == LayerScales(1.0, 1.0)
    assert calibrate_layer_scales(5.0, 5.0, get_format("fp16")) == LayerScales(1.0, 1.0)
    assert calibrate_layer_scales(0.0, float("nan"), get_format("nvfp4")) == LayerScales(1.0, 1.0)


@pytest.mark.parametrize("name", QUANT)
def test_pool_write_and_gather_roundtrip(name):
    from plugins.kv_write.reference import kv_write_ref
    from plugins.paged_attention.reference import gather_dequant

    f, H, D, B = get_format(name), 2, 32, 16
    k, v = _data(13, B, H, D, 0, 3.0)
    scales = LayerScales(0.02, 0.01)
    pools = [torch.zeros(2, B, *s.shape, dtype=s.dtype) for s in f.slot_fields(H, D)]
    arena = [torch.zeros(3, *s.shape, dtype=s.dtype) for s in f.group_fields(H, D)]
    k_group = torch.full((2, B), -1, dtype=torch.int32)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    kv_write_ref(k, v, pools, arena, k_group, torch.ones(B, dtype=torch.int32), perm, 2, f.code, scales.k, scales.v)
    kg, vg = gather_dequant(pools, arena, k_group, torch.tensor([[1]], dtype=torch.int32), f.code, scales.k, scales.v)
    slot, group = f.encode(k, v, scales)
    kr, vr = f.decode(slot, {x: t.expand(B, *t.shape) for x, t in group.items()}, scales)
    assert torch.equal(kg[0, perm], kr) and torch.equal(vg[0, perm], vr)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", QUANT)
def test_cuda_matches_cpu(name):
    f = get_format(name)
    k, v = _data(17, 11, 2, 64, 2, 4.0)
    scales = LayerScales(0.05, 0.02)
    sc, gc = f.encode(k, v, scales)
    sg, gg = f.encode(k.cuda(), v.cuda(), scales)
    assert all(torch.equal(sc[x], sg[x].cpu()) for x in sc) and all(torch.equal(gc[x], gg[x].cpu()) for x in gc)
    gx = {x: t.expand(11, *t.shape) for x, t in gg.items()}
    kd, vd = f.decode(sg, gx, scales)
    kr, vr = f.decode(sc, {x: t.cpu() for x, t in gx.items()}, scales)
    torch.testing.assert_close(kd.cpu(), kr, rtol=1e-6, atol=0)
    torch.testing.assert_close(vd.cpu(), vr, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_keys_equals_decode_from_the_key_fields_alone(name):
    """``decode_keys`` (what selection reads) is ``decode(...)[0]`` given only the ``k`` slot field."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(16, 2, 32, generator=g) * 3, torch.randn(16, 2, 32, generator=g)
    slot, group = fmt.encode(k, v, LayerScales(0.7, 1.3))
    per_slot = {n: t.expand(16, *t.shape) for n, t in group.items()}  # group fields gathered per slot
    want, _ = fmt.decode(slot, per_slot, LayerScales(0.7, 1.3))
    got = fmt.decode_keys({"k": slot["k"]}, per_slot, LayerScales(0.7, 1.3))
    assert torch.equal(got, want)
