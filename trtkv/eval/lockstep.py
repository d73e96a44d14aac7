"""Several engine cores, one forward: the fidelity replay's speed-up for engines that share weights.

A fidelity run steps the full-cache reference and every compressed engine through the same trace in
lockstep. On a CPU the dense layers of a 135M model are bound by reading the weights, so running them once
over the concatenated batch of all cores (instead of once per core) reads the weights once per step, not
once per engine. Each core still writes its own cache, runs its own policy and attends over its own pages
(``EngineCore.begin_decode`` / ``decode_layer`` / ``end_decode``); only the matmuls are shared.
"""
from __future__ import annotations

import torch

from trtkv.errors import TrtkvError
from trtkv.runtime.core import EngineCore
from trtkv.runtime.request import Request


@torch.inference_mode()
def lockstep_decode(cores: list[EngineCore], batches: list[list[Request]]) -> None:
    """One decode step of every core in ``cores`` on its own requests, with one shared dense forward."""
    model = cores[0].model
    if any(c.model is not model for c in cores):
        raise TrtkvError("lockstep decoding needs cores that share one model object (same weights and dtype)")
    steps = [c.begin_decode(b) for c, b in zip(cores, batches)]
    sizes = [len(b) for b in batches]
    cos, sin = torch.cat([s.cos for s in steps]), torch.cat([s.sin for s in steps])
    try:
        x = model.embed(torch.cat([s.ids for s in steps]))
        for layer in range(model.arch.num_hidden_layers):
            q, k, v = model.qkv(layer, x, cos, sin)
            outs = [c.decode_layer(s, layer, qi, ki, vi)
                    for c, s, qi, ki, vi in zip(cores, steps, q.split(sizes), k.split(sizes), v.split(sizes))]
            x = model.finish_layer(layer, x, torch.cat(outs))
        logits = model.logits(x)
    except BaseException:
        for c, s in zip(cores, steps):
            c.abort_decode(s)
        raise
    for c, s, lg in zip(cores, steps, logits.split(sizes)):
        c.end_decode(s, lg)
