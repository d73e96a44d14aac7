"""Torch ops the exported step graphs call besides ``torch.ops.trtkv.paged_attention``: per format, the
encoding half of ``kv_write`` (quantize and pack a flush group, without the scatter) and the decoding of
records: ``torch.ops.trtkv_export.kv_encode_<fmt>`` / ``kv_decode_<fmt>``.

One op per format because each has its own number of records (fixed-arity outputs export as plain values).
Each has the format's torch reference as its CPU kernel (so a step graph also runs eagerly, as the export's
own oracle) and a Meta kernel for tracing; ``translation.py`` maps them to ``trtkv::KVEncode_<fmt>`` and
``trtkv::KVDecode_<fmt>``.
"""
from __future__ import annotations

import torch

from plugins.formats import LayerScales, get_format

TORCH_OP_FORMATS = ("fp32", "fp16", "bf16", "fp8", "nvfp4", "nvfp4o", "ternary", "ternaryo", "int4", "int2")
_lib = torch.library.Library("trtkv_export", "DEF")


def _boundary(dtype: torch.dtype) -> torch.dtype:
    """A record's dtype at the graph boundary: bfloat16 crosses as int16 bit patterns (layout.py)."""
    return torch.int16 if dtype == torch.bfloat16 else dtype


def _record_names(fmt_name: str) -> tuple[list[str], list[str]]:
    fmt = get_format(fmt_name)
    return [f.name for f in fmt.slot_fields(1, 16)], [f.name for f in fmt.group_fields(1, 16)]


def _define(fmt_name: str) -> None:
    fmt = get_format(fmt_name)
    slot_names, group_names = _record_names(fmt_name)
    n_out = len(slot_names) + len(group_names)
    _lib.define(f"kv_encode_{fmt_name}(Tensor k, Tensor v, Tensor live, float scale_k, float scale_v) -> "
                f"({', '.join(['Tensor'] * n_out)})")
    records = ", ".join(f"Tensor {n}" for n in slot_names + group_names)
    _lib.define(f"kv_decode_{fmt_name}({records}, float scale_k, float scale_v) -> (Tensor, Tensor)")

    def encode(k, v, live, scale_k, scale_v):
        """Flush groups ``k, v [n, g, H, D]`` with ``live [n, g]`` -> slot records ``[n, g, *shape]`` then group
        records ``[n, *shape]`` (a dead row's slot record is zero)."""
        n, g, H, D = k.shape
        slot_specs, group_specs = fmt.slot_fields(H, D), fmt.group_fields(H, D)
        slot = [torch.zeros(n, g, *f.shape, dtype=f.dtype) for f in slot_specs]
        group = [torch.zeros(n, *f.shape, dtype=f.dtype) for f in group_specs]  # bit patterns at the boundary
        for i in range(n):
            rows = live[i].nonzero().flatten()
            if len(rows) == 0:
                continue
            s_enc, g_enc = fmt.encode(k[i, rows], v[i, rows], LayerScales(scale_k, scale_v))
            for t, f in zip(slot, slot_specs):
                t[i, rows] = s_enc[f.name]
            for t, f in zip(group, group_specs):
                t[i] = g_enc[f.name]
        return tuple(t.view(_boundary(t.dtype)) for t in slot + group)

    def encode_meta(k, v, live, scale_k, scale_v):
        n, g, H, D = k.shape
        return tuple([k.new_empty((n, g, *f.shape), dtype=_boundary(f.dtype)) for f in fmt.slot_fields(H, D)]
                     + [k.new_empty((n, *f.shape), dtype=_boundary(f.dtype)) for f in fmt.group_fields(H, D)])

    def decode(*args):
        """Slot records ``[..., *shape]`` followed by their group records gathered per slot -> fp32 ``k, v``."""
        *records, scale_k, scale_v = args
        dtypes = [f.dtype for f in fmt.slot_fields(1, 16) + fmt.group_fields(1, 16)]
        records = [r.view(dt) if dt == torch.bfloat16 else r for r, dt in zip(records, dtypes)]
        slot = dict(zip(slot_names, records))
        group = dict(zip(group_names, records[len(slot_names):]))
        k, v = fmt.decode(slot, group, LayerScales(scale_k, scale_v))
        return k.float().contiguous(), v.float().contiguous()

    def decode_meta(*args):
        first = args[0]  # key records [..., H, columns]: 16 channels take ``columns_of_16`` columns
        D = first.shape[-1] * 16 // fmt.slot_fields(1, 16)[0].shape[-1]
        shape = (*first.shape[:-1], D)
        return first.new_empty(shape, dtype=torch.float32), first.new_empty(shape, dtype=torch.float32)

    _lib.impl(f"kv_encode_{fmt_name}", encode, "CPU")
    _lib.impl(f"kv_encode_{fmt_name}", encode_meta, "Meta")
    _lib.impl(f"kv_decode_{fmt_name}", decode, "CPU")
    _lib.impl(f"kv_decode_{fmt_name}", decode_meta, "Meta")


for _name in TORCH_OP_FORMATS:
    _define(_name)


def kv_encode(fmt_name: str, k, v, live, scale_k: float, scale_v: float) -> list[torch.Tensor]:
    return list(getattr(torch.ops.trtkv_export, f"kv_encode_{fmt_name}")(k, v, live, scale_k, scale_v))


def kv_decode(fmt_name: str, records, scale_k: float, scale_v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return getattr(torch.ops.trtkv_export, f"kv_decode_{fmt_name}")(*records, scale_k, scale_v)
