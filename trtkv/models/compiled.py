"""The ``torch-compile`` runtime: a decoder whose dense layer pieces run through ``torch.compile`` (inductor).

Attention, the KV cache and the policies stay as in the ``torch`` runtime (the paged kernels are custom ops
inductor cannot see into); what compiles is each layer's norm + q/k/v projection + RoPE and its o_proj +
norm + MLP + residuals, and the final norm + LM head, where inductor fuses the small elementwise ops
around the matmuls. One compiled function serves every layer (the weights are arguments), so a model
compiles a handful of graphs, not one per layer. Logits differ from the eager runtime's in the last bits
(fusion reorders float operations), so greedy tokens can differ. docs/benchmarks.md measures when it helps.
"""
from __future__ import annotations

import torch

from trtkv.errors import TrtkvError
from trtkv.models.decoder import DecoderModel, head_logits, layer_finish, layer_qkv


class CompiledDecoder:
    """Wraps a :class:`DecoderModel` (shared, unmodified: the eager runtime can use it at the same time);
    every attribute but the three dense steps reads through to it."""

    def __init__(self, model: DecoderModel) -> None:
        self._model = model
        self._qkv = torch.compile(layer_qkv)
        self._finish = torch.compile(layer_finish)
        self._logits = torch.compile(head_logits)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return _run(self._qkv, x, cos, sin, *self._model._fused[layer][0])

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return _run(self._finish, x, attn, *self._model._fused[layer][1])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        norm = self._model.model.norm
        return _run(self._logits, x, norm.weight, norm.eps, self._model.lm_head.weight)


def _run(fn, *args):
    """A compiled call; a failed compilation (no C++ compiler, an unsupported op) is one error line."""
    try:
        return fn(*args)
    except torch._dynamo.exc.TorchDynamoException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrtkvError(f"torch.compile failed ({first[:200]}); run with --runtime torch") from None
