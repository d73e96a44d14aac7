"""Quantized weights on CPU: every projection and the LM head as int8 codes with one fp32 scale per output
channel (``--weights int8``) or int4 codes with one scale per output channel and group of ``G`` inputs
(``--weights int4``, ``--group-size G``, default 32: codes over each group's min..max with an fp16 scale and
minimum, as llama.cpp's Q4_1; the LM head kept in int8). Weight-only: activations stay fp32, so a request's numbers
do not depend on its batch. The ``int8_linear`` / ``int4_linear`` plugins multiply them (compiled CPU kernels
reading the codes once, blocked by 64 output channels, beside their torch references).

Why not a library's kernel (docs/benchmarks.md, "Quantized weights"): measured on this machine kind, torchao
0.18's ``Int8WeightOnlyConfig`` in eager mode dequantizes and multiplies (2-12x slower than fp32 at one row),
torch's ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu`` are 3-10x slower than fp32 at one row, and
torch's FBGEMM dynamic-quantized linear, as fast as the int8 kernel, quantizes the activations per tensor (a
batch's rows share one range; SmolLM2's top-1 agreement with fp32, whole traces in one product each, fell to
0.72). The codes are quantized once at build time and stored in the engine directory (int8 with
``torch.quantize_per_channel``'s rounding; int4 by round-to-nearest over each group's range, which torch has no
CPU quantizer for); loading only re-lays them out (``Int8Weight.pack``, ``Int4Weight.pack``).

``QuantizedDecoder`` runs the eager decoder's layer functions with the packed weights as their arguments, as
``PackedDecoder`` does for oneDNN: the model itself stays unmodified (the embedding table, norms and rotary
tables are its own).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from plugins.int4_linear.reference import Int4Weight
from plugins.int8_linear.reference import Int8Weight
from trtkv.errors import TrtkvError
from trtkv.models.decoder import DecoderModel
from trtkv.models.reweighted import ReweightedDecoder

WEIGHT_FORMATS = ("dense", "int8", "int4")  # dense: the engine's dtype as is
QUANTIZED = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32  # int4: inputs sharing one scale
_ROLES = ("qkv", "o", "gate_up", "down")


def quantized_file(fmt: str) -> str:
    """Where an engine keeps its ``fmt`` codes, relative to its directory."""
    return f"quantized/weights-{fmt}.safetensors"


def projection_weights(model: DecoderModel) -> dict[str, torch.Tensor]:
    """Every weight ``QuantizedDecoder`` multiplies, ``[out, in]``, by name (``layers.{i}.{role}``, ``lm_head``)."""
    out = {}
    for i, ((_, _, qkv_w, _, _, _, _), (o_w, _, _, gu_w, _, down_w)) in enumerate(model._fused):  # noqa: SLF001
        for role, w in zip(_ROLES, (qkv_w, o_w, gu_w, down_w)):
            out[f"layers.{i}.{role}"] = w
    out["lm_head"] = model.lm_head.weight
    return out


def check_group_size(arch, group_size: int) -> None:
    """int4 groups must be even and divide every projection's input width (``arch``: a ``ModelArch``)."""
    widths = sorted({arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.intermediate_size})
    if group_size <= 0 or group_size % 2 or any(k % group_size for k in widths):
        raise TrtkvError(f"--group-size {group_size} must be even and divide every projection's input width "
                         f"({', '.join(map(str, widths))}); {DEFAULT_GROUP_SIZE} divides the usual ones")


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` as per-output-channel symmetric int8 codes and fp32 scales ``[out]``."""
    scales = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    with warnings.catch_warnings():  # (torch marks its quantized tensors deprecated; its rounding is what we want)
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales.double(), torch.zeros(len(scales), dtype=torch.long), 0,
                                       torch.qint8)
    return q.int_repr().contiguous(), scales


FP16_TINY = 2.0 ** -14  # the smallest normal fp16: a flatter group's scale (its codes then span less than 0..15)


def _int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [out, in]`` as int4 codes in [0, 15] (uint8) over each group's range: ``w ~ code * scale + min``, fp16
    scales and mins ``[out, in / G]`` (min/max rounding, as llama.cpp's Q4_1). The codes are rounded against the
    fp16 scale and minimum the kernel multiplies by."""
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / 15.0).clamp_min(FP16_TINY).half()
    lo = lo.clamp(-65504.0, 65504.0).half()
    codes = torch.round((groups - lo.float()[..., None]) / scales.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.view(n, k).contiguous(), scales.contiguous(), lo.contiguous()


def _format_of(name: str, fmt: str) -> str:
    """int4 engines keep the LM head in int8: it turns the last hidden state into every token's logit, and at 4 bits
    it cost SmolLM2 most of its top-1 agreement (llama.cpp's 4-bit files keep it wider too)."""
    return "int8" if name == "lm_head" else fmt


def quantize(model: DecoderModel, fmt: str, group_size: int | None = None) -> dict[str, torch.Tensor]:
    """The codes of every projection (``{name}.codes [out, in]``: int8, or int4 in uint8) with their
    ``{name}.scales`` (and, int4, ``{name}.mins``)."""
    tensors = {}
    for name, w in projection_weights(model).items():
        w = w.detach().float().contiguous()
        if _format_of(name, fmt) == "int8":
            tensors[f"{name}.codes"], tensors[f"{name}.scales"] = _int8(w)
        else:
            tensors[f"{name}.codes"], tensors[f"{name}.scales"], tensors[f"{name}.mins"] = _int4(w, group_size)
    return tensors


def save_quantized(model: DecoderModel, engine_dir: Path, fmt: str, group_size: int | None = None) -> Path:
    from safetensors.torch import save_file

    path = engine_dir / quantized_file(fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(quantize(model, fmt, group_size), str(path))
    return path


def load_quantized(path: Path, model: DecoderModel, fmt: str, group_size: int | None = None
                   ) -> dict[str, torch.Tensor]:
    """The stored codes and scales, checked against the model's projection shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise TrtkvError(f"corrupt {fmt} weights {path}: {e}; rebuild the engine") from None
    for name, w in projection_weights(model).items():
        int8 = _format_of(name, fmt) == "int8"
        groups = (w.shape[0],) if int8 else (w.shape[0], w.shape[1] // group_size)
        want = {f"{name}.codes": (torch.int8 if int8 else torch.uint8, tuple(w.shape)),
                f"{name}.scales": (torch.float32 if int8 else torch.float16, groups)}
        if not int8:
            want[f"{name}.mins"] = (torch.float16, groups)
        if any(key not in tensors or (tensors[key].dtype, tuple(tensors[key].shape)) != spec
               for key, spec in want.items()):
            raise TrtkvError(f"{path} does not hold this trtkv's {fmt} codes of the model ({name}); rebuild the "
                             "engine")
    return tensors


class QuantizedDecoder(ReweightedDecoder):
    """Wraps a :class:`DecoderModel` with quantized copies of its projection weights (``tensors``: their codes and
    scales as stored)."""

    def __init__(self, model: DecoderModel, tensors: dict[str, torch.Tensor], fmt: str) -> None:
        super().__init__(model)
        packed = {}
        for name in projection_weights(model):
            if _format_of(name, fmt) == "int8":
                packed[name] = Int8Weight.pack(tensors[f"{name}.codes"], tensors[f"{name}.scales"])
            else:
                packed[name] = Int4Weight.pack(tensors[f"{name}.codes"], tensors[f"{name}.scales"],
                                               tensors[f"{name}.mins"])
        self.weight_bytes = sum(t.numel() * t.element_size() for w in packed.values() for t in w
                                if isinstance(t, torch.Tensor))  # (what a step reads, block padding included)
        for i, ((norm_w, eps, _, qkv_b, nq, nk, heads), (_, post_w, post_eps, _, ni, _)) in enumerate(model._fused):  # noqa: SLF001
            p = [packed[f"layers.{i}.{role}"] for role in _ROLES]
            self._fused.append(((norm_w, eps, p[0], qkv_b, nq, nk, heads), (p[1], post_w, post_eps, p[2], ni, p[3])))
        self._head = packed["lm_head"]


def quantized_decoder(model: DecoderModel, fmt: str, key: str, load) -> QuantizedDecoder:
    """The model's ``fmt`` decoder for the weights ``key`` names (``load()``: their codes and scales), made once
    and owned by the model, so engines sharing a model and its quantized weights share one packed copy."""
    cache = model.__dict__.setdefault("_quantized_decoders", {})
    dec = cache.get((fmt, key))
    if dec is None:
        dec = cache[(fmt, key)] = QuantizedDecoder(model, load(), fmt)
    return dec
