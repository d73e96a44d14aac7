"""Registers the plugins as ``torch.ops.trtkv.*`` custom ops with fake (meta) implementations.

Each op dispatches to its Triton kernel when ``plugins.backend.use_triton`` says so, else to the torch
reference beside it.
"""
from __future__ import annotations

import torch

from plugins.backend import use_triton
from plugins.kv_write.reference import kv_write_ref
from plugins.paged_attention.reference import paged_attention_ref


@torch.library.custom_op("trtkv::kv_write", mutates_args=("slot_fields", "group_fields", "k_group"))
def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_fields: list[torch.Tensor],
    group_fields: list[torch.Tensor],
    k_group: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
    gid: int,
    fmt_code: int,
    scale_k: float,
    scale_v: float,
) -> None:
    if use_triton(k):
        from plugins.kv_write.triton_kernel import kv_write_triton

        kv_write_triton(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v)
    else:
        kv_write_ref(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v)


@kv_write.register_fake
def _(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v) -> None:
    return None


@torch.library.custom_op("trtkv::paged_attention", mutates_args=())
def paged_attention(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code, sm_scale, scale_k, scale_v, return_logits)
    if use_triton(q):
        from plugins.paged_attention.triton_kernel import paged_attention_triton

        return paged_attention_triton(*args)
    return paged_attention_ref(*args)


@paged_attention.register_fake
def _(q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code, sm_scale, scale_k, scale_v, return_logits):
    b, Hq, D = q.shape
    n = block_table.shape[1] * slot_fields[0].shape[1] if return_logits else 0
    out = q.new_empty((b, Hq, D), dtype=torch.float32)
    lse = q.new_empty((b, Hq), dtype=torch.float32)
    logits = q.new_empty((b, Hq, n) if return_logits else (0,), dtype=torch.float32)
    return out, lse, logits
