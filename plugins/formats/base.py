"""The KV storage-format contract every pool, kernel and policy shares.

A format says how one token's post-RoPE K and V are stored in a page slot. Fields come in two kinds:

* slot fields: stored per slot in the page pool, tensors shaped ``[num_pages, block_size, *shape]``;
* group fields: stored once per *flush group* (the ``group_size`` tokens quantized together) in a
  key-scale arena shaped ``[num_groups, *shape]``; each slot points at its group through the pool's
  ``k_group`` index. Per-channel key scales need this because slot reuse scatters a group's tokens.

Axis order inside a page is NHD: ``[page, slot, kv_head, ...]``.
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FieldSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class LayerScales:
    """Static FP32 per-(layer, K|V) scales: NVFP4/ternary second-level scale, FP8 tensor scale.

    1.0 when no calibration was run. Build-time calibration sets them from observed amax.
    """

    k: float = 1.0
    v: float = 1.0


@dataclass(frozen=True)
class KVFormat(abc.ABC):
    """Base class; subclasses implement encode/decode with a torch reference."""

    name: str
    code: int  # stable id used in engine.json and kernels
    group_size: int = 1  # tokens per flush; 1 means write-through (no residual buffer)
    element_bits: float = 16.0  # element bits only (the paper's "average precision" convention)
    description: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)

    # --- layout -----------------------------------------------------------------------------
    @abc.abstractmethod
    def slot_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]: ...

    def group_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]:
        return []

    def slot_bytes(self, num_heads: int, head_dim: int) -> int:
        return sum(f.nbytes for f in self.slot_fields(num_heads, head_dim))

    def group_bytes(self, num_heads: int, head_dim: int) -> int:
        return sum(f.nbytes for f in self.group_fields(num_heads, head_dim))

    @property
    def quantized(self) -> bool:
        return self.group_size > 1

    # --- math (torch reference) -------------------------------------------------------------
    @abc.abstractmethod
    def encode(
        self, k: torch.Tensor, v: torch.Tensor, scales: LayerScales
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Quantize one flush group.

        Args:
            k, v: ``[n, H, D]`` post-RoPE keys/values, ``1 <= n <= group_size`` (n < group_size is a
                partial group, e.g. the prompt's tail).
        Returns:
            (slot, group): slot tensors ``[n, *spec.shape]`` per slot field; group tensors
            ``[*spec.shape]`` per group field.
        """

    @abc.abstractmethod
    def decode(
        self, slot: dict[str, torch.Tensor], group: dict[str, torch.Tensor], scales: LayerScales
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize to fp32. ``slot[f]`` is ``[..., *shape]``; ``group[f]`` is already gathered
        per slot, so it is ``[..., *shape]`` with the same leading dims. Returns k, v ``[..., H, D]``."""

    @abc.abstractmethod
    def decode_keys(self, slot: dict[str, torch.Tensor], group: dict[str, torch.Tensor], scales: LayerScales
                    ) -> torch.Tensor:
        """``decode(...)[0]`` from the key fields alone (``slot`` needs only ``"k"``; ``group`` is all key
        statistics): selection reads keys only, so it gathers and dequantizes half the bytes."""


@functools.cache
def field_names(fmt_code: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(slot field names, group field names) of a format, in kernel argument order."""
    from plugins.formats import format_by_code

    fmt = format_by_code(fmt_code)
    return tuple(f.name for f in fmt.slot_fields(1, 16)), tuple(f.name for f in fmt.group_fields(1, 16))
