"""The ``trtkv``-domain ONNX functions against the torch references of plugins/formats and paged_attention:
ONNX Runtime encodes the same bytes ``kv_write`` stores (partial flush groups included) and attends the
pages to float rounding. Each function runs alone in a one-node model, as a plugin replacing it would."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from plugins.formats import LayerScales, get_format
from plugins.kv_write.reference import kv_write_ref
from plugins.paged_attention.reference import paged_attention_ref
from trtkv.export.format_functions import _E4M3_VALUES, EXPORTABLE_FORMATS, format_functions
from trtkv.export.functions import function_proto, library
from trtkv.export.layout import NUMPY_DTYPE, to_boundary

H, D, HQ = 2, 32, 4


def _value_info(name: str, t: torch.Tensor | None = None, elem: int | None = None):
    if t is None:
        return helper.make_tensor_value_info(name, elem, None)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(to_boundary(t).dtype), list(t.shape))


def _run_one(fmt_name: str, fn_name: str, inputs: dict[str, torch.Tensor], outputs: list[tuple[str, int]], **attrs):
    node = helper.make_node(fn_name, list(inputs), [n for n, _ in outputs], domain="trtkv", **attrs)
    graph = helper.make_graph([node], "one", [_value_info(n, t) for n, t in inputs.items()],
                              [_value_info(n, elem=e) for n, e in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("trtkv", 1)],
                              functions=[function_proto(f, 20) for f in library([fmt_name])])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: to_boundary(t) for n, t in inputs.items()})


def _elem(dtype: torch.dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(NUMPY_DTYPE[dtype]))


@pytest.mark.parametrize("name", EXPORTABLE_FORMATS)
def test_encode_is_bit_exact(name):
    fmt = get_format(name)
    g = fmt.group_size
    torch.manual_seed(0)
    k, v = torch.randn(4, g, H, D) * 3, torch.randn(4, g, H, D)
    k[0, :, 0, :16] = 0.0  # an all-zero scale group
    k[1, 0, 1, 3] = -0.0
    live = torch.ones(4, g, dtype=torch.bool)
    if g > 1:
        live[2, 11:] = False  # a partial group (the prompt's tail) and a one-token group
        live[3, 1:] = False
    specs = fmt.slot_fields(H, D) + fmt.group_fields(H, D)
    got = _run_one(name, format_functions(name).encode.name, {"k": k, "v": v, "live": live},
                   [(f"o{i}", _elem(f.dtype)) for i, f in enumerate(specs)], scale_k=0.011, scale_v=0.023)
    n_slot = len(fmt.slot_fields(H, D))
    for row in range(4):
        rows = live[row].nonzero().flatten()
        slot, group = fmt.encode(k[row, rows], v[row, rows], LayerScales(0.011, 0.023))
        for i, f in enumerate(specs):
            ref = to_boundary(slot[f.name] if i < n_slot else group[f.name])
            out = got[i][row, rows.numpy()] if i < n_slot else got[i][row]
            assert np.array_equal(ref.view(np.uint8), np.ascontiguousarray(out).view(np.uint8)), (name, f.name, row)


@pytest.mark.parametrize("name", EXPORTABLE_FORMATS)
def test_paged_attention_matches_reference(name):
    fmt = get_format(name)
    B, pages, g = 8, 6, fmt.group_size
    torch.manual_seed(1)
    slot = [torch.zeros(pages, B, *f.shape, dtype=f.dtype) for f in fmt.slot_fields(H, D)]
    group = [torch.zeros(2 * pages, *f.shape, dtype=f.dtype) for f in fmt.group_fields(H, D)]
    k_group = torch.full((pages, B), -1, dtype=torch.int32)
    gid = 0
    for p in range(pages):  # groups of up to g tokens per page, each with its own arena entry
        for s0 in range(0, B, min(g, B)):
            n = min(g, B - s0)
            kv_write_ref(torch.randn(n, H, D) * 3, torch.randn(n, H, D), slot, group, k_group, torch.full((n,), p),
                         torch.arange(s0, s0 + n), gid if group else -1, fmt.code, 0.05, 0.03)
            gid += 1
    valid = torch.randint(0, 1 << B, (pages,), dtype=torch.int32)
    valid[4] = 0  # a page with nothing live
    block_table = torch.tensor([[3, 1, 5], [0, 2, -1], [4, -1, -1]], dtype=torch.int32)  # row 2: nothing live
    q = torch.randn(3, HQ, D)
    inputs = {"q": q, **{f"s{i}": t for i, t in enumerate(slot)}, **{f"g{i}": t for i, t in enumerate(group)}}
    if group:
        inputs["k_group"] = k_group
    inputs |= {"valid": valid, "block_table": block_table}
    got = _run_one(name, format_functions(name).paged_attention.name, inputs,
                   [("out", onnx.TensorProto.FLOAT), ("lse", onnx.TensorProto.FLOAT),
                    ("logits", onnx.TensorProto.FLOAT)], sm_scale=0.125, scale_k=0.05, scale_v=0.03)
    ref = paged_attention_ref(q, slot, group, k_group, valid, block_table, fmt.code, 0.125, 0.05, 0.03, True)
    for out, r in zip(got, ref):
        r = r.numpy()
        assert np.array_equal(np.isfinite(out), np.isfinite(r))
        assert np.allclose(out[np.isfinite(r)], r[np.isfinite(r)], atol=2e-6, rtol=1e-5)
    assert np.all(got[0][2] == 0) and np.all(np.isneginf(got[1][2]))  # nothing live: out 0, lse -inf


def _edge_floats() -> torch.Tensor:
    """Rounding ties and near-ties of bfloat16 and E4M3, subnormals, overflow, signed zeros, inf and NaN."""
    torch.manual_seed(2)
    bits = torch.randint(0, 1 << 16, (4096,), dtype=torch.int32)
    ties = ((bits << 16) | 0x8000).view(torch.float32)  # exactly half a bfloat16 ulp above a bfloat16 value
    e4m3 = torch.tensor(_E4M3_VALUES.tolist(), dtype=torch.float32)
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                      torch.nextafter(mids, torch.zeros_like(mids))])
    wide = torch.randn(4096) * torch.exp2(torch.randint(-140, 128, (4096,)).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38, 3.4e38, -3.4e38,
                            1e-45, -1e-45, 2.0**-126, 2.0**-133, 448.0, 464.0, 480.0, 1e6, 2.0**-10, 2.0**-9])
    return torch.cat([ties, -ties, near, -near, wide, special])


def test_bf16_bits_round_to_nearest_even_and_back():
    x = _edge_floats()
    (got,) = _run_one("bf16", "Bf16Encode", {"x": x}, [("y", onnx.TensorProto.INT16)])
    ref = x.to(torch.bfloat16).view(torch.int16).numpy()
    nan = torch.isnan(x).numpy()  # any NaN pattern (torch's depends on the CPU path)
    assert np.array_equal(got[~nan], ref[~nan])
    assert np.all((got[nan] & 0x7F80) == 0x7F80) and np.all(got[nan] & 0x7F)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    (dec,) = _run_one("bf16", "Bf16Decode", {"bits": every}, [("y", onnx.TensorProto.FLOAT)])
    want = every.view(torch.bfloat16).float().numpy()
    assert np.array_equal(np.isnan(dec), np.isnan(want))
    assert np.array_equal(dec[~np.isnan(want)].view(np.int32), want[~np.isnan(want)].view(np.int32))  # -0.0 too


def test_e4m3_nearest_matches_reference():
    from plugins.formats.e4m3 import e4m3_encode

    x = _edge_floats()
    x = x[~torch.isnan(x)]  # NaN stores 0 with the input's sign bit in torch; the graphs store 0x00
    (got,) = _run_one("fp8", "E4M3EncodeNearest", {"x": x}, [("y", onnx.TensorProto.UINT8)])
    assert np.array_equal(got, e4m3_encode(x).numpy())
