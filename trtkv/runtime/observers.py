"""Observers: tools (bench, eval, calibration, tests) watch an ``EngineCore`` without patching it.

An observer may ask for attention statistics (computed for every request, whatever the policy asks; the
policy still sees only what *it* asked for), and is called with each step's logits and statistics. It must
not change what the engine computes. Each tool builds the core it needs with its observers
(``Engine.make_core``) instead of flipping attributes on a live one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trtkv.policies.base import StatsRequest, StepStats

if TYPE_CHECKING:
    from trtkv.runtime.request import GenerationResult, Request


class EngineObserver:
    """Base observer: every hook is a no-op. Subclass and override what you need."""

    def stats_request(self, phase: str) -> StatsRequest | None:
        """Attention statistics this observer needs at every decode step (``phase == "decode"``), for every
        request; prefill statistics are not forced (``on_prefill`` sees what the policy asked for)."""
        return None

    def on_prefill(self, req: Request, logits: torch.Tensor, stats: StepStats) -> None:
        """After a request's prefill forward (``logits [1, V]`` fp32), before its first token is sampled."""

    def before_attention(self, reqs: list[Request], layer: int) -> None:
        """In a decode step, per layer, after the cache writes and the policy's ``before_attention``: what
        ``req.ctx`` holds now is exactly what this layer attends."""

    def on_decode(self, reqs: list[Request], logits: torch.Tensor, stats: list[StepStats]) -> None:
        """After a batched decode forward (``logits [b, V]``), before sampling; ``stats[i]`` holds the forced
        statistics of ``reqs[i]`` (the layers this observer asked for)."""

    def on_step_end(self, reqs: list[Request]) -> None:
        """After the step's tokens are appended and the policy's end-of-step hooks ran."""

    def on_finish(self, req: Request, result: GenerationResult) -> None:
        """When a request finishes, before its pages are freed (``req.ctx`` can still read its KV)."""


def merge_stats_requests(reqs: list[StatsRequest | None]) -> StatsRequest | None:
    """One request that covers all of ``reqs`` (union of layers and of what is asked)."""
    reqs = [r for r in reqs if r is not None]
    if not reqs:
        return None
    layers: set[int] | None = set()
    for r in reqs:
        if r.layers is None:
            layers = None
            break
        layers |= set(r.layers)
    return StatsRequest(layers=None if layers is None else tuple(sorted(layers)),
                        weights=any(r.weights for r in reqs), sparsity=any(r.sparsity for r in reqs),
                        prefill_window=max(r.prefill_window for r in reqs), queries=any(r.queries for r in reqs))
