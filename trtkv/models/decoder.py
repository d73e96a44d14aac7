"""trtkv's own Llama / Qwen2 decoder. The runtime drives it layer by layer and owns attention.

The model exposes the pieces around attention (``qkv``, ``finish_layer``, ``logits``) so the runtime can
write K/V into its paged cache and call the ``paged_attention`` plugin in between. Weights keep the
transformers names so safetensors checkpoints load unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugins import ops as plugin_ops
from plugins.int4_linear.reference import Int4Weight
from plugins.int8_linear.reference import Int8Weight
from trtkv.models.config import ModelArch
from trtkv.models.rope import Rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMS normalization (plugins/rms_norm/reference.py); fp32 rows on CPU run the compiled kernel."""
    return plugin_ops.rms_norm(x, weight, eps)


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
    def fuse_projections(self, input_major: bool | None = None) -> "DecoderModel":
        """Store q/k/v and gate/up weights contiguously so each is one matmul; the original parameters
        become views into the fused tensors (no extra memory).

        ``input_major`` (default: on CPU) stores every projection as ``[in, out]`` and multiplies ``x @ W``:
        on CPU the BLAS reads that layout at a markedly higher bandwidth for the skinny (decode) products —
        measured on the 2-core VM over SmolLM2's 538 MB of fp32 weights: 24.5 vs 32.6 ms per token, and the
        49152 x 576 LM head 27 vs 16 GB/s (docs/benchmarks.md). The embedding then gathers columns of the
        transposed (tied) table, so no copy of the weights is kept."""
        if input_major is None:
            input_major = self.model.embed_tokens.weight.device.type == "cpu"
        self._input_major = input_major
        self._fused = []  # per layer: the arguments of layer_qkv and of layer_finish after the activations
        arch = self.arch
        att_heads = (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim)
        for blk in self.model.layers:
            att, mlp = blk.self_attn, blk.mlp
            qkv_w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
            qkv_b = (torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
                     if att.q_proj.bias is not None else None)
            gu_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            if input_major:  # [out, in] views of [in, out] storage
                qkv_w = qkv_w.t().contiguous().t()
                gu_w = gu_w.t().contiguous().t()
                mlp.down_proj.weight = nn.Parameter(mlp.down_proj.weight.t().contiguous().t(), requires_grad=False)
                att.o_proj.weight = nn.Parameter(att.o_proj.weight.t().contiguous().t(), requires_grad=False)
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
            n_in, n_post = blk.input_layernorm, blk.post_attention_layernorm
            self._fused.append(((n_in.weight, n_in.eps, qkv_w, qkv_b, nq, nk, att_heads),
                                (att.o_proj.weight, n_post.weight, n_post.eps, gu_w, ni, mlp.down_proj.weight)))
        if input_major:
            head = self.lm_head.weight.t().contiguous().t()
            self.lm_head.weight = nn.Parameter(head, requires_grad=False)
            if self.arch.tie_word_embeddings:
                self.model.embed_tokens.weight = self.lm_head.weight
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, hidden]`` -> post-RoPE ``q [T, Hq, D]``, ``k, v [T, H, D]``."""
        return layer_qkv(x, cos, sin, *self._fused[layer][0])

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor, attn_sum=None, mlp_sum=None
                     ) -> torch.Tensor:
        """Residual + o_proj + MLP. ``attn [T, Hq, D]``; ``attn_sum`` / ``mlp_sum`` (tensor parallelism, see
        trtkv/models/sharding.py) sum the row-parallel o_proj / down_proj partial products across ranks."""
        return layer_finish(x, attn, *self._fused[layer][1], attn_sum=attn_sum, mlp_sum=mlp_sum)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return head_logits(x, self.model.norm.weight, self.model.norm.eps, self.lm_head.weight)


# The dense pieces of a layer as functions of their weights: DecoderModel calls them per layer, and the
# torch-compile runtime (trtkv/models/compiled.py) compiles each once for every layer, as the weights are
# arguments rather than attributes a guard would specialize on.
def layer_qkv(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_w: torch.Tensor, eps: float,
              qkv_w: torch.Tensor, qkv_b: torch.Tensor | None, nq: int, nk: int, heads: tuple[int, int, int]):
    Hq, H, D = heads
    T = x.shape[0]
    qkv = _linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b)
    qk = plugin_ops.rotary(qkv[:, :nq + nk].view(T, Hq + H, D), cos, sin)
    v = qkv[:, nq + nk:].reshape(T, H, D)
    return qk[:, :Hq], qk[:, Hq:], v


def layer_finish(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, post_w: torch.Tensor, eps: float,
                 gu_w: torch.Tensor, ni: int, down_w: torch.Tensor, attn_sum=None, mlp_sum=None) -> torch.Tensor:
    o = _linear(attn.reshape(attn.shape[0], -1).to(x.dtype), o_w)
    x = x + (o if attn_sum is None else attn_sum(o))
    gu = _linear(rms_norm(x, post_w, eps), gu_w)
    d = _linear(F.silu(gu[:, :ni]) * gu[:, ni:], down_w)
    return x + (d if mlp_sum is None else mlp_sum(d))


def head_logits(x: torch.Tensor, norm_w: torch.Tensor, eps: float, head_w: torch.Tensor) -> torch.Tensor:
    return _linear(rms_norm(x, norm_w, eps), head_w).float()


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for ``w [out, in]``; an input-major ``w`` (a transposed view of ``[in, out]`` storage,
    see ``fuse_projections``) is multiplied as stored, without letting ``F.linear`` pick the slow layout; a
    oneDNN-packed ``w`` (trtkv/models/packed.py) runs oneDNN's inner product."""
    if isinstance(w, (Int8Weight, Int4Weight)):  # quantized codes and scales (trtkv/models/quantized_weights.py)
        if torch.compiler.is_compiling():  # a compiled program calls the registered kernel
            ops = plugin_ops.program_ops(x)
            y = ops.int8_linear(x, *w) if isinstance(w, Int8Weight) else ops.int4_linear(x, *w)
        else:
            y = plugin_ops.int8_linear(x, *w) if isinstance(w, Int8Weight) else plugin_ops.int4_linear(x, w)
        return y if b is None else y + b
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")
    if w.stride(0) == 1 and w.dim() == 2 and w.shape[1] > 1:
        wt = w.t()
        return torch.addmm(b, x, wt) if b is not None else x @ wt
    return F.linear(x, w, b)
