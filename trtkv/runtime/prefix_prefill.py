"""Prefill over token ids at given positions with a sequence's cached tokens as prefix.

What ArborKV's lazy rehydration runs (spec §3.6): the block's stored token ids at their *original*
positions, attending to the cached tokens below the block (the ancestors' pages) plus causal attention
inside the block; only the offsets that were evicted are written back. It reads the cache through the
request API and writes through the cache manager, so quantized formats get their usual flush groups.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from trtkv.runtime.context import RequestContext


@torch.inference_mode()
def prefill_at(core, ctx: RequestContext, token_ids: list[int], start: int, write: list[int],
               cls: tuple[str, int, int]) -> torch.Tensor:
    """Run ``token_ids`` at positions ``start..`` over ``ctx``'s cached tokens below ``start``; store the
    K/V of positions ``write`` (a subset) in class ``cls`` = (format, thought, segment); returns the
    logits after the last token ``[V]``."""
    model, cache, seq = core.model, core.cache, ctx.seq
    T = len(token_ids)
    positions = torch.arange(start, start + T, device=core.device)
    cos, sin = model.rotary.cos_sin(positions, core.dtype)
    x = model.embed(torch.tensor(token_ids, device=core.device))
    widx = torch.tensor([p - start for p in write], dtype=torch.long, device=core.device)
    g = core.g
    causal = torch.ones(T, T, dtype=torch.bool, device=core.device).tril()
    for layer in range(core.arch.num_hidden_layers):
        q, k, v = model.qkv(layer, x, cos, sin)
        held = ctx.all_positions(layer)
        held = held[held < start]
        kc, vc = ctx.kv_local(layer, held)  # this rank's heads, as q, k, v are
        K = torch.cat([kc.to(q.dtype), k]).transpose(0, 1)[None]
        V = torch.cat([vc.to(q.dtype), v]).transpose(0, 1)[None]
        mask = torch.cat([torch.ones(T, len(held), dtype=torch.bool, device=core.device), causal], 1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K, V, attn_mask=mask, scale=core.sm_scale,
                                              enable_gqa=True)[0].transpose(0, 1)
        if len(write):
            kw, vw = k[widx].float(), v[widx].float()
            step = g if g > 1 else len(write)  # quantized formats: one flush group per g tokens
            for s in range(0, len(write), step):
                cache.write(seq, layer, kw[s:s + step], vw[s:s + step], list(write[s:s + step]), cls[:2], cls[2])
        x = model.finish_layer(layer, x, attn)
    return model.logits(x[-1:])[0]


def span_missing(ctx: RequestContext, start: int, n: int) -> list[int]:
    """Positions of ``[start, start+n)`` not held in layer 0 (the tree keeps one token set for all layers)."""
    held = ctx.all_positions(0)
    have = set(held[(held >= start) & (held < start + n)].tolist())
    return [p for p in range(start, start + n) if p not in have]


def entropy_confidence(logits: torch.Tensor) -> float:
    """MSVE's boundary confidence ``u = 1 - H(p) / log|V|`` (exact, full vocabulary)."""
    logp = torch.log_softmax(logits.float(), -1)
    h = float(-(logp.exp() * logp).nan_to_num().sum())
    return float(np.clip(1.0 - h / np.log(logits.shape[-1]), 0.0, 1.0))
