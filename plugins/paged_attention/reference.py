"""Torch reference for paged decode attention over one format's pages (the oracle for the Triton kernel)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plugins.formats import LayerScales, format_by_code
from plugins.formats.base import field_names


_BIT_LUT: dict[tuple[int, str], torch.Tensor] = {}


def _bit_table(block_size: int, device: torch.device) -> torch.Tensor:
    """``[2**B, B]`` bool: row w lists the set bits of w (for B <= 12; one gather instead of shift/and)."""
    key = (block_size, str(device))
    if key not in _BIT_LUT:
        w = torch.arange(1 << block_size, device=device)[:, None]
        _BIT_LUT[key] = ((w >> torch.arange(block_size, device=device)) & 1).bool()
    return _BIT_LUT[key]


def slot_validity(valid_bits: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[b, P*B]`` bool: slot s of page p is live iff bit s of ``valid_bits[p]`` is set; -1 pads (and a
    padded entry reads page 0's word, so it is masked by the -1 test)."""
    pages = block_table.clamp_min(0).long()
    if block_size <= 12:
        words = torch.where(block_table >= 0, valid_bits[pages], 0).long()
        return _bit_table(block_size, valid_bits.device)[words].reshape(block_table.shape[0], -1)
    bits = valid_bits[pages].unsqueeze(-1)  # [b, P, 1]
    shifts = torch.arange(block_size, device=bits.device, dtype=bits.dtype)
    live = ((bits >> shifts) & 1).bool() & (block_table >= 0).unsqueeze(-1)
    return live.reshape(block_table.shape[0], -1)


def gather_dequant(
    slot_fields: list[torch.Tensor],
    group_fields: list[torch.Tensor],
    k_group: torch.Tensor,
    block_table: torch.Tensor,
    fmt_code: int,
    scale_k: float,
    scale_v: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K, V ``[b, P*B, H, D]`` fp32 for the pages in ``block_table`` (padding reads page 0)."""
    pages = block_table.clamp_min(0).long()
    b = pages.shape[0]
    if fmt_code in _FLOAT_CODES:  # stored as-is: the gather is the dequantization
        flat = pages.view(-1)
        kp, vp = slot_fields[0], slot_fields[1]
        k = kp.view(kp.shape[0], -1).index_select(0, flat).view(b, -1, *kp.shape[2:]).float()
        v = vp.view(vp.shape[0], -1).index_select(0, flat).view(b, -1, *vp.shape[2:]).float()
        return k, v
    else:
        names, gnames = field_names(fmt_code)
        slot = {n: t[pages] for n, t in zip(names, slot_fields)}
        group = {}
        if group_fields:
            gid = k_group[pages].clamp_min(0).long()  # [b, P, B]
            group = {n: t[gid] for n, t in zip(gnames, group_fields)}
        k, v = format_by_code(fmt_code).decode(slot, group, LayerScales(scale_k, scale_v))
    return k.reshape(b, -1, *k.shape[-2:]), v.reshape(b, -1, *v.shape[-2:])


@dataclass(frozen=True)
class PagedFormat:
    """One format's pages of a layer as an attention call reads them (``paged_attention_ref``'s arguments)."""

    slot_fields: list[torch.Tensor]
    group_fields: list[torch.Tensor]
    k_group: torch.Tensor
    valid_bits: torch.Tensor
    block_table: torch.Tensor
    fmt_code: int
    scale_k: float
    scale_v: float


_FLOAT_CODES = (0, 1, 2)  # fp32, fp16, bf16 (plugins/formats/floating.py)


def paged_attention_ref(
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
    """Decode attention of one query token per sequence over its pages of one format.

    Args:
        q: ``[b, Hq, D]``. Query heads ``h*G .. h*G+G-1`` share KV head ``h``.
        block_table: ``[b, P]`` int32 page ids, -1 padded.
    Returns:
        out ``[b, Hq, D]`` fp32 (normalized within these pages; 0 where nothing is live),
        lse ``[b, Hq]`` fp32 (log-sum-exp of the scaled logits; -inf where nothing is live),
        logits ``[b, Hq, P*B]`` fp32 scaled logits with -inf at dead slots (empty unless asked).
    Partial results over several formats and the residual buffer merge with ``merge_partials``.
    """
    b, Hq, D = q.shape
    if block_table.shape[1] == 0:  # no page of this format left (a policy evicted all of them): nothing live
        return (q.new_zeros(b, Hq, D, dtype=torch.float32), q.new_full((b, Hq), -math.inf, dtype=torch.float32),
                q.new_zeros(b, Hq, 0, dtype=torch.float32) if return_logits else q.new_empty(0, dtype=torch.float32))
    k, v = gather_dequant(slot_fields, group_fields, k_group, block_table, fmt_code, scale_k, scale_v)
    H = k.shape[2]
    G = Hq // H
    block_size = slot_fields[0].shape[1]
    if not return_logits and q.device.type == "cpu" and block_size <= 12:
        return _attend_fused_cpu(q, k, v, valid_bits, block_table, sm_scale)
    live = slot_validity(valid_bits, block_table, block_size)  # [b, n]
    qf = q.float().view(b, H, G, D)
    logits = torch.matmul(qf, k.permute(0, 2, 3, 1)) * sm_scale  # [b, H, G, n]
    logits = logits.masked_fill(~live[:, None, None, :], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # [b, H, G]
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.matmul(p, v.transpose(1, 2)).reshape(b, Hq, D)
    lse = lse.reshape(b, Hq)
    logits_out = logits.reshape(b, Hq, -1) if return_logits else q.new_empty(0, dtype=torch.float32)
    return out, lse, logits_out


def _attend_fused_cpu(q, k, v, valid_bits, block_table, sm_scale):
    """Same math through aten's fused CPU attention, which also returns the log-sum-exp. GQA without
    copying K/V: the G query heads of a group ride in the (non-causal) query-length dimension. The
    additive mask comes straight from the validity words by table. A row with no live key comes back
    as output 0 with lse 0; its lse is set to -inf (merge_partials' contract)."""
    b, Hq, D = q.shape
    H = k.shape[2]
    words = torch.where(block_table >= 0, valid_bits[block_table.clamp_min(0).long()], 0).long()  # [b, P]
    mask = _mask_table(block_table.shape[1] and k.shape[1] // block_table.shape[1], q.device)[words]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float().view(b, H, Hq // H, D), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), 0.0, False,
        attn_mask=mask.view(b, 1, 1, -1), scale=sm_scale)
    lse = torch.where((words != 0).any(-1, keepdim=True), lse.reshape(b, Hq), -math.inf)
    return out.reshape(b, Hq, D), lse, q.new_empty(0, dtype=torch.float32)


def dense_attention_cpu(q, slot_fields, dense_run, sm_scale):
    """Attention of one sequence whose live tokens are the first ``n`` slots of a page run: a view of
    the pool, no gather and no mask (see plugins.ops.paged_attention)."""
    first, n = dense_run
    kp, vp = slot_fields[0], slot_fields[1]
    B = kp.shape[1]
    H, D = kp.shape[2], kp.shape[3]
    k = kp.view(-1, H, D)[first * B: first * B + n].float()
    v = vp.view(-1, H, D)[first * B: first * B + n].float()
    Hq = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float().view(1, H, Hq // H, D), k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], 0.0, False,
        scale=sm_scale)
    return out.reshape(1, Hq, D), lse.reshape(1, Hq), q.new_empty(0, dtype=torch.float32)


def _mask_table(block_size: int, device) -> torch.Tensor:
    """``[2**B, B]`` fp32 additive mask rows (0 live, -inf dead) per validity word."""
    key = (block_size, str(device), "mask")
    if key not in _BIT_LUT:
        _BIT_LUT[key] = torch.where(_bit_table(block_size, device), 0.0, -math.inf)
    return _BIT_LUT[key]


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_partials`` over a split axis held in one tensor (``out [b,Hq,S,D]``, ``lse [b,Hq,S]``): a fixed
    handful of ops whatever ``S``, not two per split (on a GPU the per-split ops' launches, not the kernel,
    were most of a batch-1 decode attention call: docs/benchmarks.md, GPU). Today's kernel merges inside its
    launch; the 2026-11-27 kernel that ``gpu_check.sh`` times beside it still calls this."""
    total = torch.logsumexp(lse, dim=2)
    w = torch.nan_to_num(torch.exp(lse - total.clamp_min(-1e30).unsqueeze(-1)), nan=0.0)
    return (w.unsqueeze(-1) * out).sum(2), total


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of partial attentions ``(out [b,Hq,D], lse [b,Hq])`` into one."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])  # [n, b, Hq]
    total = torch.logsumexp(lses, dim=0)
    w = torch.nan_to_num(torch.exp(lses - total.clamp_min(-1e30)), nan=0.0)
    out = sum(w[i].unsqueeze(-1) * parts[i][0] for i in range(len(parts)))
    return out, total
