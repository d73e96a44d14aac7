"""CPU weights prepacked for oneDNN: the decode step's projections without the BLAS's small-batch path.

MKL's sgemm takes a slow path for the few-row products of decoding (1-64 rows against 576-49152 columns),
markedly so on AMD cores; oneDNN's inner-product primitive over weights reordered once into its blocked
layout runs them 1.4-2.4x faster on the AMD EPYC VM (docs/benchmarks.md). ``PackedDecoder`` runs the same
layer functions as the eager decoder (``layer_qkv``, ``layer_finish``, ``head_logits``) with packed copies
of the projection weights as their arguments; ``_linear`` multiplies a packed weight through oneDNN. The
model itself stays unmodified (ONNX export and the other runtimes read its plain weights), so the packed
copies cost one more copy of the projection weights in host memory; engines sharing a model share them.
"""
from __future__ import annotations

import torch

from trtkv.models.decoder import DecoderModel
from trtkv.models.reweighted import ReweightedDecoder

# the batch the oneDNN reorder is tuned for (the layout works for any row count; 16 measured best for
# batches 1-64 on the AMD VM)
PACK_ROWS = 16


def packing_available(model: DecoderModel) -> bool:
    """oneDNN packs fp32 weights on CPU; other dtypes and devices run the plain weights."""
    w = model.lm_head.weight
    return (w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``w [out, in]`` (any strides) as an opaque oneDNN tensor for ``_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)


class PackedDecoder(ReweightedDecoder):
    """Wraps a :class:`DecoderModel` with oneDNN-packed copies of its projection weights. Build it with
    :func:`packed_decoder`, which packs a model's weights once."""

    def __init__(self, model: DecoderModel) -> None:
        super().__init__(model)
        for (norm_w, eps, qkv_w, qkv_b, nq, nk, heads), (o_w, post_w, post_eps, gu_w, ni, down_w) in model._fused:
            self._fused.append(((norm_w, eps, pack_weight(qkv_w), qkv_b, nq, nk, heads),
                                (pack_weight(o_w), post_w, post_eps, pack_weight(gu_w), ni, pack_weight(down_w))))
        self._head = pack_weight(model.lm_head.weight)


def packed_decoder(model: DecoderModel) -> PackedDecoder:
    """The model's packed decoder, made on first use and owned by the model (engines sharing a model share
    one packed copy; it refers back weakly, so no reference cycle keeps 2x the weights alive)."""
    packed = model.__dict__.get("_packed_decoder")
    if packed is None:
        packed = model.__dict__["_packed_decoder"] = PackedDecoder(model)
    return packed
