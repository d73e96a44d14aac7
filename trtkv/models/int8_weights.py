"""int8 weights on CPU: every projection and the LM head as int8 codes with one fp32 scale per output channel
(symmetric, weight-only: activations stay fp32, so a request's numbers do not depend on its batch), multiplied
by the ``int8_linear`` plugin (plugins/int8_linear: a compiled CPU kernel reading the codes once, blocked by 64
output channels, beside its torch reference).

Why not a library's kernel (docs/benchmarks.md, "int8 weights"): measured on this machine kind, torchao 0.18's
``Int8WeightOnlyConfig`` in eager mode dequantizes and multiplies (2-12x slower than fp32 at one row), torch's
``_weight_int8pack_mm`` is 3-5x slower than fp32 at one row, and torch's FBGEMM dynamic-quantized linear, as
fast as this kernel, quantizes the activations per tensor (a batch's rows share one range; SmolLM2's top-1
agreement with fp32, whole traces in one product each, fell to 0.72). The codes are quantized once at build time
(``torch.quantize_per_channel``'s rounding, in torch) and stored in the engine directory; loading only
re-lays them out (``Int8Weight.pack``).

``Int8Decoder`` runs the eager decoder's layer functions with the packed weights as their arguments, as
``PackedDecoder`` does for oneDNN: the model itself stays unmodified (the embedding table, norms and rotary
tables are its own).
"""
from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import torch

from plugins.int8_linear.reference import Int8Weight
from trtkv.errors import TrtkvError
from trtkv.models.decoder import DecoderModel, head_logits, layer_finish, layer_qkv

WEIGHT_FORMATS = ("dense", "int8")  # dense: the engine's dtype as is
INT8_FILE = "quantized/weights-int8.safetensors"
_ROLES = ("qkv", "o", "gate_up", "down")


def projection_weights(model: DecoderModel) -> dict[str, torch.Tensor]:
    """Every weight ``Int8Decoder`` multiplies, ``[out, in]``, by name (``layers.{i}.{role}``, ``lm_head``)."""
    out = {}
    for i, ((_, _, qkv_w, _, _, _, _), (o_w, _, _, gu_w, _, down_w)) in enumerate(model._fused):  # noqa: SLF001
        for role, w in zip(_ROLES, (qkv_w, o_w, gu_w, down_w)):
            out[f"layers.{i}.{role}"] = w
    out["lm_head"] = model.lm_head.weight
    return out


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` as per-output-channel symmetric int8 codes and fp32 scales."""
    w = w.detach().float().contiguous()
    scales = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    with warnings.catch_warnings():  # (torch marks its quantized tensors deprecated; its rounding is what we want)
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales.double(), torch.zeros(len(scales), dtype=torch.long), 0,
                                       torch.qint8)
    return q.int_repr().contiguous(), scales


def quantize_int8(model: DecoderModel) -> dict[str, torch.Tensor]:
    """The int8 codes and scales of every projection: ``{name}.codes [out, in] int8``, ``{name}.scales [out]``."""
    tensors = {}
    for name, w in projection_weights(model).items():
        tensors[f"{name}.codes"], tensors[f"{name}.scales"] = _quantized(w)
    return tensors


def save_int8(model: DecoderModel, engine_dir: Path) -> Path:
    from safetensors.torch import save_file

    path = engine_dir / INT8_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(quantize_int8(model), str(path))
    return path


def load_int8(path: Path, model: DecoderModel) -> dict[str, torch.Tensor]:
    """The stored codes and scales, checked against the model's projection shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise TrtkvError(f"{path} is missing: the engine was built with --weights int8; rebuild it")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise TrtkvError(f"corrupt int8 weights {path}: {e}; rebuild the engine") from None
    for name, w in projection_weights(model).items():
        codes, scales = tensors.get(f"{name}.codes"), tensors.get(f"{name}.scales")
        if codes is None or scales is None or codes.dtype != torch.int8 or tuple(codes.shape) != tuple(w.shape) \
                or tuple(scales.shape) != (w.shape[0],):
            raise TrtkvError(f"{path} does not match the model ({name}); rebuild the engine")
    return tensors


class Int8Decoder:
    """Wraps a :class:`DecoderModel` (shared, unmodified) with int8 copies of its projection weights; every
    attribute but the three dense steps reads through to the model."""

    def __init__(self, model: DecoderModel, tensors: dict[str, torch.Tensor]) -> None:
        self._model_ref = weakref.ref(model)
        packed = {name: Int8Weight.pack(tensors[f"{name}.codes"], tensors[f"{name}.scales"])
                  for name in projection_weights(model)}
        self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._fused = []
        for i, ((norm_w, eps, _, qkv_b, nq, nk, heads), (_, post_w, post_eps, _, ni, _)) in enumerate(model._fused):  # noqa: SLF001
            p = [packed[f"layers.{i}.{role}"] for role in _ROLES]
            self._fused.append(((norm_w, eps, p[0], qkv_b, nq, nk, heads), (p[1], post_w, post_eps, p[2], ni, p[3])))
        self._head = packed["lm_head"]

    @property
    def _model(self) -> DecoderModel:
        return self._model_ref()

    def __getattr__(self, name: str):
        if name == "_model_ref":
            raise AttributeError(name)
        return getattr(self._model, name)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return layer_qkv(x, cos, sin, *self._fused[layer][0])

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return layer_finish(x, attn, *self._fused[layer][1])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        norm = self._model.model.norm
        return head_logits(x, norm.weight, norm.eps, self._head)


def int8_decoder(model: DecoderModel, key: str, load) -> Int8Decoder:
    """The model's int8 decoder for the weights ``key`` names (``load()``: their codes and scales), made once and
    owned by the model, so engines sharing a model and its int8 weights share one packed copy."""
    cache = model.__dict__.setdefault("_int8_decoders", {})
    dec = cache.get(key)
    if dec is None:
        dec = cache[key] = Int8Decoder(model, load())
    return dec
