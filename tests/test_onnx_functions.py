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
from trtkv.export.format_functions import EXPORTABLE_FORMATS, format_functions
from trtkv.export.functions import function_proto, library

H, D, HQ = 2, 32, 4


def _value_info(name: str, t: torch.Tensor | None = None, elem: int | None = None):
    if t is None:
        return helper.make_tensor_value_info(name, elem, None)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(t.numpy().dtype), list(t.shape))


def _run_one(fmt_name: str, fn_name: str, inputs: dict[str, torch.Tensor], outputs: list[tuple[str, int]], **attrs):
    node = helper.make_node(fn_name, list(inputs), [n for n, _ in outputs], domain="trtkv", **attrs)
    graph = helper.make_graph([node], "one", [_value_info(n, t) for n, t in inputs.items()],
                              [_value_info(n, elem=e) for n, e in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("trtkv", 1)],
                              functions=[function_proto(f, 20) for f in library([fmt_name])])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: t.numpy() for n, t in inputs.items()})


def _elem(dtype: torch.dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=dtype).numpy().dtype)


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
            ref = (slot[f.name] if i < n_slot else group[f.name]).numpy()
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
