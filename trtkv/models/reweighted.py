"""``ReweightedDecoder``: a :class:`DecoderModel`'s three dense steps run on substituted copies of its projection
weights (oneDNN-packed fp32, int8 or int4 codes), the model itself shared and unmodified; every other attribute
reads through to it. Subclasses fill ``_fused`` (per layer, the arguments of ``layer_qkv`` and ``layer_finish``
after the activations) and ``_head``."""
from __future__ import annotations

import weakref

import torch

from trtkv.models.decoder import DecoderModel, head_logits, layer_finish, layer_qkv


class ReweightedDecoder:
    def __init__(self, model: DecoderModel) -> None:
        self._model_ref = weakref.ref(model)  # the model owns this (it caches it): no cycle
        self._fused: list = []
        self._head = None

    @property
    def _model(self) -> DecoderModel:
        return self._model_ref()

    def __getattr__(self, name: str):
        if name == "_model_ref":
            raise AttributeError(name)
        return getattr(self._model, name)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return layer_qkv(x, cos, sin, *self._fused[layer][0])

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor, attn_sum=None, mlp_sum=None
                     ) -> torch.Tensor:
        return layer_finish(x, attn, *self._fused[layer][1], attn_sum=attn_sum, mlp_sum=mlp_sum)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        norm = self._model.model.norm
        return head_logits(x, norm.weight, norm.eps, self._head)
