"""Megatron-style tensor parallelism for trtkv's decoder: which slice of every weight a rank holds, and the
decoder wrapper that puts the collectives between the slices.

q/k/v and gate/up are column-parallel (a rank computes its heads' and its slice of the MLP's channels), o_proj
and down_proj row-parallel (each rank's partial product, summed by one all-reduce each per layer), the LM head
vocabulary-parallel (each rank's slice of the logits, gathered). KV heads are split across ranks when their
count divides by the group size, so each rank's cache holds its heads' pages; otherwise (SmolLM2 has 3) every
rank holds every head and computes the attention block in full, and only the MLP is split. The embedding table
and the norms are replicated.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from trtkv.distributed.group import TensorParallelGroup
from trtkv.errors import TrtkvError
from trtkv.models.config import ModelArch
from trtkv.models.decoder import DecoderModel


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size``: what it holds of a model of architecture ``arch``."""
    rank: int
    size: int
    heads_sharded: bool  # KV (and query) heads split across ranks; else replicated
    mlp_sharded: bool  # the MLP's intermediate channels split; else replicated
    vocab_chunk: int  # rows of the LM head a rank holds (the last rank's slice padded with zero rows)

    @classmethod
    def for_arch(cls, arch: ModelArch, rank: int, size: int) -> "ShardPlan":
        if size < 1 or not 0 <= rank < size:
            raise TrtkvError(f"rank {rank} is not in a tensor-parallel group of {size}")
        return cls(rank, size, heads_sharded=arch.num_key_value_heads % size == 0,
                   mlp_sharded=arch.intermediate_size % size == 0,
                   vocab_chunk=-(-arch.vocab_size // size))

    def local_arch(self, arch: ModelArch) -> ModelArch:
        """The architecture of this rank's slice (head counts and MLP width); head_dim stays the model's."""
        h = self.size if self.heads_sharded else 1
        m = self.size if self.mlp_sharded else 1
        return dataclasses.replace(arch, num_attention_heads=arch.num_attention_heads // h,
                                   num_key_value_heads=arch.num_key_value_heads // h,
                                   intermediate_size=arch.intermediate_size // m, tie_word_embeddings=False)

    def _part(self, n: int, sharded: bool) -> slice:
        if not sharded:
            return slice(0, n)
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def q_rows(self, arch: ModelArch) -> slice:
        return self._part(arch.num_attention_heads * arch.head_dim, self.heads_sharded)

    def kv_rows(self, arch: ModelArch) -> slice:
        return self._part(arch.num_key_value_heads * arch.head_dim, self.heads_sharded)

    def mlp_rows(self, arch: ModelArch) -> slice:
        return self._part(arch.intermediate_size, self.mlp_sharded)

    def vocab_rows(self, arch: ModelArch) -> slice:
        lo = self.rank * self.vocab_chunk
        return slice(min(lo, arch.vocab_size), min(lo + self.vocab_chunk, arch.vocab_size))


@torch.no_grad()
def shard_model(full: DecoderModel, plan: ShardPlan) -> DecoderModel:
    """This rank's slice of ``full`` as a decoder of the local architecture (fused, as ``build_model`` returns
    them). The embedding and norms are copies of ``full``'s, so ``full`` can be dropped."""
    arch = full.arch
    local = plan.local_arch(arch)
    w0 = full.model.embed_tokens.weight
    with torch.device("meta"):
        part = DecoderModel(local)
    q, kv, mlp = plan.q_rows(arch), plan.kv_rows(arch), plan.mlp_rows(arch)

    def param(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.contiguous().clone(), requires_grad=False)

    part.model.embed_tokens.weight = param(w0)
    part.model.norm.weight = param(full.model.norm.weight)
    for src, dst in zip(full.model.layers, part.model.layers):
        sa, da = src.self_attn, dst.self_attn
        da.q_proj.weight, da.k_proj.weight, da.v_proj.weight = (
            param(sa.q_proj.weight[q]), param(sa.k_proj.weight[kv]), param(sa.v_proj.weight[kv]))
        if sa.q_proj.bias is not None:
            da.q_proj.bias, da.k_proj.bias, da.v_proj.bias = (
                param(sa.q_proj.bias[q]), param(sa.k_proj.bias[kv]), param(sa.v_proj.bias[kv]))
        da.o_proj.weight = param(sa.o_proj.weight[:, q])
        sm, dm = src.mlp, dst.mlp
        dm.gate_proj.weight, dm.up_proj.weight = param(sm.gate_proj.weight[mlp]), param(sm.up_proj.weight[mlp])
        dm.down_proj.weight = param(sm.down_proj.weight[:, mlp])
        dst.input_layernorm.weight = param(src.input_layernorm.weight)
        dst.post_attention_layernorm.weight = param(src.post_attention_layernorm.weight)
    head = full.lm_head.weight[plan.vocab_rows(arch)]
    if head.shape[0] < plan.vocab_chunk:  # the last rank's short slice: zero rows, trimmed after the gather
        head = torch.cat([head, head.new_zeros(plan.vocab_chunk - head.shape[0], head.shape[1])])
    part.lm_head = nn.Linear(arch.hidden_size, plan.vocab_chunk, bias=False, device="meta")
    part.lm_head.weight = param(head)
    part.rotary.inv_freq = full.rotary.inv_freq.clone()
    return part.eval().fuse_projections()


class TensorParallelDecoder:
    """A rank's decoder (plain or reweighted: oneDNN-packed) with the group's collectives between its slices.
    ``arch`` is the whole model's, what the engine core and the policies see; every other attribute reads
    through to the wrapped decoder."""

    def __init__(self, inner, arch: ModelArch, plan: ShardPlan, group: TensorParallelGroup):
        self._inner = inner
        self.arch = arch
        self.plan = plan
        self.group = group
        self._attn_sum = group.all_reduce if plan.heads_sharded else None
        self._mlp_sum = group.all_reduce if plan.mlp_sharded else None

    def __getattr__(self, name: str):
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self._inner.qkv(layer, x, cos, sin)

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return self._inner.finish_layer(layer, x, attn, self._attn_sum, self._mlp_sum)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather(self._inner.logits(x), -1)[..., :self.arch.vocab_size]

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (its slices, the replicated embedding and norms)."""
        return sum(p.numel() * p.element_size() for p in self._inner.parameters())
