"""The exporter's custom translation table: each KV plugin call becomes one ``trtkv::<Function>_<format>`` node.

The format is a compile-time property of the call (``fmt_code`` of ``paged_attention``, the op name of
``kv_encode_<fmt>`` / ``kv_decode_<fmt>``), so it selects the function; the float arguments become the node's
attributes (``sm_scale``, ``scale_k``, ``scale_v``): the schema a TensorRT plugin or an ONNX Runtime custom op
of the same name implements (docs/deploy.md).
"""
from __future__ import annotations

import torch

import plugins  # noqa: F401  (registers torch.ops.trtkv.*)
from plugins.formats import format_by_code, get_format
from trtkv.export.attention_functions import TRTKV
from trtkv.export.torch_ops import TORCH_OP_FORMATS


def _paged_attention(q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code: int,
                     sm_scale: float, scale_k: float, scale_v: float, return_logits: bool):
    name = format_by_code(fmt_code).name
    inputs = [q, *slot_fields, *group_fields] + ([k_group] if group_fields else []) + [valid_bits, block_table]
    fn = getattr(TRTKV, f"PagedAttention_{name}")
    return fn(*inputs, sm_scale=sm_scale, scale_k=scale_k, scale_v=scale_v)


def _encoder(name: str):
    def kv_encode(k, v, live, scale_k: float, scale_v: float):
        return getattr(TRTKV, f"KVEncode_{name}")(k, v, live, scale_k=scale_k, scale_v=scale_v)

    return kv_encode


def _decoder(name: str):
    """Records per format family: (k, v), (k, v, v_scale, k_scale), (k, v, v_scale, k_scale, k_offset) or
    (k, v, v_scale, v_zero, k_scale, k_zero)."""
    n = len(get_format(name).slot_fields(1, 16)) + len(get_format(name).group_fields(1, 16))

    def call(records, scale_k, scale_v):
        return getattr(TRTKV, f"KVDecode_{name}")(*records, scale_k=scale_k, scale_v=scale_v)

    if n == 2:
        def kv_decode(k, v, scale_k: float, scale_v: float):
            return call([k, v], scale_k, scale_v)
    elif n == 4:
        def kv_decode(k, v, v_scale, k_scale, scale_k: float, scale_v: float):
            return call([k, v, v_scale, k_scale], scale_k, scale_v)
    elif n == 5:
        def kv_decode(k, v, v_scale, k_scale, k_offset, scale_k: float, scale_v: float):
            return call([k, v, v_scale, k_scale, k_offset], scale_k, scale_v)
    else:  # int4 / int2: value scale and zero per slot, key scale and zero per group
        def kv_decode(k, v, v_scale, v_zero, k_scale, k_zero, scale_k: float, scale_v: float):
            return call([k, v, v_scale, v_zero, k_scale, k_zero], scale_k, scale_v)
    return kv_decode


def translation_table() -> dict:
    table = {torch.ops.trtkv.paged_attention.default: _paged_attention}
    for name in TORCH_OP_FORMATS:
        table[getattr(torch.ops.trtkv_export, f"kv_encode_{name}").default] = _encoder(name)
        table[getattr(torch.ops.trtkv_export, f"kv_decode_{name}").default] = _decoder(name)
    return table
