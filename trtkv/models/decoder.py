"""trtkv's own Llama / Qwen2 decoder. The runtime drives it layer by layer and owns attention.

The model exposes the pieces around attention (``qkv``, ``finish_layer``, ``logits``) so the runtime can
write K/V into its paged cache and call the ``paged_attention`` plugin in between. Weights keep the
transformers names so safetensors checkpoints load unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtkv.models.config import ModelArch
from trtkv.models.rope import Rotary, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        H, Hq, D = arch.num_key_value_heads, arch.num_attention_heads, arch.head_dim
        bias = arch.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, Hq * D, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, H * D, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, H * D, bias=bias)
        self.o_proj = nn.Linear(Hq * D, arch.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class DecoderModel(nn.Module):
    """Token-parallel pieces of a decoder; the runtime calls them around its own attention."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.model = Backbone(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.rope_scaling)

    @property
    def num_layers(self) -> int:
        return self.arch.num_hidden_layers

    def to(self, *args, **kwargs):  # keep the rotary table on the model's device
        out = super().to(*args, **kwargs)
        self.rotary.inv_freq = self.rotary.inv_freq.to(self.model.embed_tokens.weight.device)
        return out

    @torch.no_grad()
    def fuse_projections(self) -> "DecoderModel":
        """Store q/k/v and gate/up weights contiguously so each is one matmul; the original parameters
        become views into the fused tensors (no extra memory)."""
        self._fused = []
        for blk in self.model.layers:
            att, mlp = blk.self_attn, blk.mlp
            qkv_w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
            qkv_b = (torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
                     if att.q_proj.bias is not None else None)
            gu_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            nq, nk = att.q_proj.weight.shape[0], att.k_proj.weight.shape[0]
            att.q_proj.weight, att.k_proj.weight, att.v_proj.weight = (
                nn.Parameter(qkv_w[:nq], requires_grad=False), nn.Parameter(qkv_w[nq:nq + nk], requires_grad=False),
                nn.Parameter(qkv_w[nq + nk:], requires_grad=False))
            if qkv_b is not None:
                att.q_proj.bias, att.k_proj.bias, att.v_proj.bias = (
                    nn.Parameter(qkv_b[:nq], requires_grad=False), nn.Parameter(qkv_b[nq:nq + nk], requires_grad=False),
                    nn.Parameter(qkv_b[nq + nk:], requires_grad=False))
            ni = mlp.gate_proj.weight.shape[0]
            mlp.gate_proj.weight = nn.Parameter(gu_w[:ni], requires_grad=False)
            mlp.up_proj.weight = nn.Parameter(gu_w[ni:], requires_grad=False)
            self._fused.append((blk.input_layernorm, qkv_w, qkv_b, nq, nk, att.o_proj.weight,
                                blk.post_attention_layernorm, gu_w, ni, mlp.down_proj.weight))
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, hidden]`` -> post-RoPE ``q [T, Hq, D]``, ``k, v [T, H, D]``."""
        arch = self.arch
        norm, qkv_w, qkv_b, nq, nk = self._fused[layer][:5]
        T = x.shape[0]
        qkv = F.linear(norm(x), qkv_w, qkv_b)
        Hq = arch.num_attention_heads
        qk = apply_rotary(qkv[:, :nq + nk].view(T, Hq + arch.num_key_value_heads, arch.head_dim), cos, sin)
        v = qkv[:, nq + nk:].reshape(T, arch.num_key_value_heads, arch.head_dim)
        return qk[:, :Hq], qk[:, Hq:], v

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj + MLP. ``attn [T, Hq, D]``."""
        _, _, _, _, _, o_w, post_norm, gu_w, ni, down_w = self._fused[layer]
        x = x + F.linear(attn.reshape(attn.shape[0], -1).to(x.dtype), o_w)
        gu = F.linear(post_norm(x), gu_w)
        return x + F.linear(F.silu(gu[:, :ni]) * gu[:, ni:], down_w)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x)).float()
