"""What crosses the boundary of the exported step graphs: every input and output by name, dtype and shape.

The paged state is explicit. Per layer and storage format the decode step reads the pool's slot records
``l{L}.{fmt}.{field}`` ``[pages, block, ...]``, its key-scale arena ``[groups, ...]`` with the per-slot group
index ``k_group``, the validity words ``valid [pages]`` (bit s: slot s live) and the batch's ``block_table
[batch, table]`` (-1 padded); with a residual group (quantized formats) also the full-precision buffer. It
returns the logits and, per layer and format, the *encoded records* of this step's write unit (the token, or
the flush group it completes) that the host stores into the slots it reserved; the pools themselves are never
copied through the graph. ``attn_logits`` per layer are the scaled attention logits over everything the step
attended (for policies that read attention statistics).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plugins.formats import get_format

# dtype of a tensor at the graph boundary: bfloat16 crosses as its int16 bit patterns (numpy, and so ONNX Runtime's
# and Polygraphy's Python APIs, have no bfloat16); every other dtype as itself
NUMPY_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "int16",
               torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
               torch.bool: "bool"}


def to_boundary(t: torch.Tensor) -> np.ndarray:
    """A host tensor as the graphs take it (zero-copy): bfloat16 as its int16 bit patterns."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def from_boundary(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A graph output as a host tensor of ``dtype`` (zero-copy): int16 bit patterns back to bfloat16."""
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output; a ``str`` dimension is symbolic."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], d["dtype"], tuple(d["shape"]))


@dataclass(frozen=True)
class KVLayout:
    """The engine geometry the graphs are specialised to (everything but the symbolic sizes)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    group: int  # residual group g: 1 = write-through, else tokens buffered before a quantized flush
    formats: tuple[str, ...]  # storage formats the policy writes, in input order
    residual_dtype: str  # the buffer's dtype (float16 for fp32 models)
    buffers_prompt_tail: bool  # the prompt's last len % g tokens stay buffered (else flushed as a partial group)

    # --- per pool ---------------------------------------------------------------------------------
    def slot_fields(self, fmt: str) -> list:
        return get_format(fmt).slot_fields(self.num_kv_heads, self.head_dim)

    def group_fields(self, fmt: str) -> list:
        return get_format(fmt).group_fields(self.num_kv_heads, self.head_dim)

    def pool_inputs(self, layer: int, fmt: str) -> list[TensorSpec]:
        """A (layer, format) pool: slot records, arena, group index, validity words, block table."""
        p, pages = f"l{layer}.{fmt}.", f"pages_l{layer}_{fmt}"
        out = [TensorSpec(p + f.name, NUMPY_DTYPE[f.dtype], (pages, self.block_size, *f.shape))
               for f in self.slot_fields(fmt)]
        gfields = self.group_fields(fmt)
        out += [TensorSpec(p + f.name, NUMPY_DTYPE[f.dtype], (f"groups_l{layer}_{fmt}", *f.shape)) for f in gfields]
        if gfields:
            out.append(TensorSpec(p + "k_group", "int32", (pages, self.block_size)))
        out += [TensorSpec(p + "valid", "int32", (pages,)),
                TensorSpec(p + "block_table", "int32", ("batch", f"table_l{layer}_{fmt}"))]
        return out

    def write_outputs(self, layer: int, fmt: str, rows: str) -> list[TensorSpec]:
        """The encoded write unit of one layer in one format: ``rows`` groups of ``group`` tokens."""
        p = f"l{layer}.{fmt}.write."
        return ([TensorSpec(p + f.name, NUMPY_DTYPE[f.dtype], (rows, self.group, *f.shape))
                 for f in self.slot_fields(fmt)]
                + [TensorSpec(p + f.name, NUMPY_DTYPE[f.dtype], (rows, *f.shape)) for f in self.group_fields(fmt)])

    # --- decode step ------------------------------------------------------------------------------
    def decode_inputs(self) -> list[TensorSpec]:
        L, g, H, D = self.num_layers, self.group, self.num_kv_heads, self.head_dim
        out = [TensorSpec("input_ids", "int64", ("batch",)), TensorSpec("positions", "int64", ("batch",))]
        if len(self.formats) > 1:
            out.append(TensorSpec("write_format", "int64", ("batch",)))
        if g > 1:
            out += [TensorSpec("buffer_k", self.residual_dtype, (L, "batch", g, H, D)),
                    TensorSpec("buffer_v", self.residual_dtype, (L, "batch", g, H, D)),
                    TensorSpec("buffer_len", "int64", ("batch",))]
        for layer in range(L):
            for fmt in self.formats:
                out += self.pool_inputs(layer, fmt)
        return out

    def decode_outputs(self) -> list[TensorSpec]:
        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        out = [TensorSpec("logits", "float32", ("batch", self.vocab_size))]
        # the step's raw K/V: the buffer's new row, and what ``trtkv export --check`` re-encodes in PyTorch
        out += [TensorSpec(n, "float32", (L, "batch", H, D)) for n in ("k_new", "v_new")]
        for layer in range(L):
            for fmt in self.formats:
                out += self.write_outputs(layer, fmt, "batch")
        out += [TensorSpec(f"l{layer}.attn_logits", "float32", ("batch", self.num_q_heads, f"keys_l{layer}"))
                for layer in range(L)]
        return out

    # --- prefill ----------------------------------------------------------------------------------
    def prefill_inputs(self) -> list[TensorSpec]:
        return [TensorSpec("input_ids", "int64", ("prompt",))]

    def prefill_outputs(self) -> list[TensorSpec]:
        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        out = [TensorSpec("logits", "float32", (1, self.vocab_size))]
        out += [TensorSpec("k", "float32", (L, "prompt", H, D)), TensorSpec("v", "float32", (L, "prompt", H, D))]
        rows = "prompt" if self.group == 1 else "prompt_groups"
        for layer in range(L):
            for fmt in self.formats:
                out += self.write_outputs(layer, fmt, rows)
        return out

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["formats"] = list(self.formats)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(**{**d, "formats": tuple(d["formats"])})
