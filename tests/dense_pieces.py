"""Shared check for alternative dense runtimes (packed weights, torch.compile): each of a decoder's dense
pieces computes what the plain eager decoder does, to fp32 rounding."""
from __future__ import annotations

import torch


@torch.inference_mode()
def assert_pieces_match(model, dense, rows: tuple[int, ...], atol_logits: float = 1e-4) -> None:
    """``model``: the plain decoder; ``dense``: the wrapper under test; ``rows``: batch sizes to try."""
    g = torch.Generator().manual_seed(0)
    for T in rows:
        x = torch.randn(T, model.arch.hidden_size, generator=g)
        cos, sin = model.rotary.cos_sin(torch.arange(7, 7 + T), torch.float32)
        for layer in range(model.arch.num_hidden_layers):
            want, got = model.qkv(layer, x, cos, sin), dense.qkv(layer, x, cos, sin)
            for a, b in zip(want, got):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            attn = want[0]
            torch.testing.assert_close(dense.finish_layer(layer, x, attn), model.finish_layer(layer, x, attn),
                                       rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense.logits(x), model.logits(x), rtol=1e-5, atol=atol_logits)
