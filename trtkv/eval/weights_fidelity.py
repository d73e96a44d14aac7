"""Fidelity of a weight format against the dense weights: both engines' decoders read the same token ids
(a trace's prompt and completion) in one causal forward each, and every position's next-token logits are
compared (top-1 agreement, KL(dense || test)). The KV cache plays no part: this isolates the weights."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trtkv.errors import TrtkvError
from trtkv.eval.fidelity import kl_divergence, top1_agreement


@torch.inference_mode()
def teacher_forced_logits(engine, ids: list[int]) -> torch.Tensor:
    """``[T, V]`` next-token logits of ``ids`` through ``engine``'s dense decoder (exact causal attention)."""
    dense = engine.core.model
    arch = engine.arch
    x = dense.embed(torch.tensor(ids, device=engine.core.device))
    cos, sin = dense.rotary.cos_sin(torch.arange(len(ids), device=x.device), engine.core.dtype)
    group = arch.num_attention_heads // arch.num_key_value_heads
    for layer in range(arch.num_hidden_layers):
        q, k, v = dense.qkv(layer, x, cos, sin)  # [T, Hq, D], [T, H, D]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                              v.transpose(0, 1).float(), is_causal=True,
                                              scale=1.0 / math.sqrt(arch.head_dim))
        x = dense.finish_layer(layer, x, attn.transpose(0, 1).to(x.dtype))
    return dense.logits(x)


def compare_weights(reference, test, token_lists: list[list[int]]) -> dict[str, float]:
    """Top-1 agreement and mean KL of ``test``'s logits against ``reference``'s over every position of every
    id list (engines of one model that differ in their weight format)."""
    if reference.manifest.model.alias != test.manifest.model.alias:
        raise TrtkvError(f"{test.path} and {reference.path} are different models; compare weight formats of one model")
    agree, kl, n = 0.0, 0.0, 0
    for ids in token_lists:
        ref, got = teacher_forced_logits(reference, ids), teacher_forced_logits(test, ids)
        agree += float(top1_agreement(ref, got).sum())
        kl += float(kl_divergence(ref, got).sum())
        n += len(ids)
    return {"top1_agreement": agree / max(n, 1), "kl_mean": kl / max(n, 1), "positions": n}
