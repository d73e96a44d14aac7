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
from pathlib import Path

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


def slice_table(arch: ModelArch, plan: ShardPlan) -> dict[str, tuple[slice | None, slice | None]]:
    """Every checkpoint tensor a rank holds, by its transformers name: ``(rows, cols)`` of the whole tensor
    (None: all of that axis). The LM head's rows come from the embedding when the weights are tied."""
    q, kv, mlp = plan.q_rows(arch), plan.kv_rows(arch), plan.mlp_rows(arch)
    table: dict[str, tuple[slice | None, slice | None]] = {"model.embed_tokens.weight": (None, None),
                                                           "model.norm.weight": (None, None)}
    for i in range(arch.num_hidden_layers):
        pre = f"model.layers.{i}."
        table.update({
            pre + "self_attn.q_proj.weight": (q, None), pre + "self_attn.k_proj.weight": (kv, None),
            pre + "self_attn.v_proj.weight": (kv, None), pre + "self_attn.o_proj.weight": (None, q),
            pre + "mlp.gate_proj.weight": (mlp, None), pre + "mlp.up_proj.weight": (mlp, None),
            pre + "mlp.down_proj.weight": (None, mlp),
            pre + "input_layernorm.weight": (None, None), pre + "post_attention_layernorm.weight": (None, None)})
        if arch.attention_bias:
            table.update({pre + "self_attn.q_proj.bias": (q, None), pre + "self_attn.k_proj.bias": (kv, None),
                          pre + "self_attn.v_proj.bias": (kv, None)})
    table["lm_head.weight"] = (plan.vocab_rows(arch), None)
    return table


def _cut(t, rows: slice | None, cols: slice | None) -> torch.Tensor:
    """``t[rows, cols]`` of a tensor or a safetensors slice (which reads only that part of the file)."""
    if rows is not None and cols is not None:
        return t[rows, cols]
    if rows is not None:
        return t[rows]
    if cols is not None:
        return t[:, cols]
    return t[:]


@torch.no_grad()
def assemble_shard(arch: ModelArch, plan: ShardPlan, parts: dict[str, torch.Tensor], dtype: torch.dtype,
                   device) -> DecoderModel:
    """The rank's decoder (fused, as ``build_model`` returns them) from its slices by checkpoint name."""
    local = plan.local_arch(arch)
    with torch.device("meta"):
        part = DecoderModel(local)
    head = parts["lm_head.weight"]
    if head.shape[0] < plan.vocab_chunk:  # the last rank's short slice: zero rows, trimmed after the gather
        head = torch.cat([head, head.new_zeros(plan.vocab_chunk - head.shape[0], head.shape[1])])
    part.lm_head = nn.Linear(arch.hidden_size, plan.vocab_chunk, bias=False, device="meta")
    params = dict(part.named_parameters())
    for name in params:
        t = head if name == "lm_head.weight" else parts[name]
        owner, _, attr = name.rpartition(".")
        setattr(part.get_submodule(owner), attr,
                nn.Parameter(t.to(torch.float32).to(device=device, dtype=dtype).contiguous(), requires_grad=False))
    part.rotary.inv_freq = part.rotary.inv_freq.to(device)
    return part.eval().fuse_projections()


def load_shard(arch: ModelArch, plan: ShardPlan, dtype: torch.dtype, device, files: list[Path] | None,
               seed: int = 0) -> DecoderModel:
    """This rank's slice of a checkpoint, read as slices (a rank never holds the whole model), or of the synthetic
    weights ``build_model(arch, ..., seed=seed)`` draws (drawn one tensor at a time, in its order, so both agree)."""
    table = slice_table(arch, plan)
    if arch.tie_word_embeddings:
        table.pop("lm_head.weight")
    parts: dict[str, torch.Tensor] = {}
    if files is None:
        on_gpu = torch.device(device).type == "cuda"
        g = torch.Generator(device=device if on_gpu else "cpu").manual_seed(seed)
        with torch.device("meta"):
            shapes = DecoderModel(arch)
        for name, p in shapes.named_parameters():  # build_model's draw order (tied weights once)
            full = torch.empty(p.shape, device=device if on_gpu else "cpu")
            full.fill_(1.0) if name.endswith("norm.weight") else full.normal_(0.0, 0.02, generator=g)
            full = full.to(dtype)  # (build_model draws in fp32 and converts)
            if name in table:
                parts[name] = _cut(full, *table[name]).clone()
            if name == "model.embed_tokens.weight" and arch.tie_word_embeddings:
                parts["lm_head.weight"] = full[plan.vocab_rows(arch)].clone()
    else:
        from safetensors import SafetensorError, safe_open

        for f in files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                        if name in table:
                            parts[name] = _cut(st.get_slice(name), *table[name])
                        if name == "model.embed_tokens.weight" and arch.tie_word_embeddings:
                            parts["lm_head.weight"] = _cut(st.get_slice(name), plan.vocab_rows(arch), None)
            except (SafetensorError, OSError) as e:
                raise TrtkvError(f"corrupt weights file {f}: {e}") from None
        missing = [k for k in table if k not in parts]
        if missing:
            raise TrtkvError(f"weights are missing {len(missing)} tensors (first: {missing[0]}); "
                             "is this the right checkpoint?")
    return assemble_shard(arch, plan, parts, dtype, device)


def shard_model(full: DecoderModel, plan: ShardPlan) -> DecoderModel:
    """This rank's slice of a loaded model (tests; ``load_shard`` reads a rank's slice without the whole)."""
    arch = full.arch
    table = slice_table(arch, plan)
    sd = {k: v.detach() for k, v in full.named_parameters(remove_duplicate=False)}
    parts = {name: _cut(sd[name], *cut) for name, cut in table.items()}
    w = full.model.embed_tokens.weight
    return assemble_shard(arch, plan, parts, w.dtype, w.device)


class TensorParallelDecoder:
    """A rank's decoder (plain or reweighted: oneDNN-packed) with the group's collectives between its slices.
    ``arch`` is the whole model's, what the engine core and the policies see; every other attribute reads
    through to the wrapped decoder."""

    def __init__(self, inner, arch: ModelArch, plan: ShardPlan, group: TensorParallelGroup):
        self._inner = inner
        self.arch = arch
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
