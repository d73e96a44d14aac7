"""Per-layer amax of post-RoPE K and V over a few calibration prompts (prefill only).

Quantized formats use them for their static second-level (NVFP4, ternary) or tensor (FP8) scales, so
per-group E4M3 scales sit in range instead of underflowing; spec §3.2 fixes s_glob from calibration.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from trtkv.artifacts.calibration import KVAmax
from trtkv.paths import PACKAGE_DIR


def calibration_texts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (PACKAGE_DIR / "data" / "calibration_prompts.jsonl").open()]
    return [r["question"] for r in rows[:n]]


@torch.inference_mode()
def collect_kv_amax(model, tokenizer, n_prompts: int = 8, max_len: int = 512) -> KVAmax:
    L = model.arch.num_hidden_layers
    k_amax, v_amax = [0.0] * L, [0.0] * L
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device
    for text in calibration_texts(n_prompts):
        ids = torch.tensor(tokenizer.encode_prompt(text, True)[:max_len], device=device)
        cos, sin = model.rotary.cos_sin(torch.arange(len(ids), device=device), dtype)
        x = model.embed(ids)
        for layer in range(L):
            q, k, v = model.qkv(layer, x, cos, sin)
            k_amax[layer] = max(k_amax[layer], float(k.abs().max()))
            v_amax[layer] = max(v_amax[layer], float(v.abs().max()))
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            x = model.finish_layer(layer, x, attn[0].transpose(0, 1))
    return KVAmax(tuple(k_amax), tuple(v_amax), n_prompts, "prefill amax over calibration prompts")
