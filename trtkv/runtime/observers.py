"""Observers: tools (bench, eval, calibration, tests) watch an ``EngineCore`` without patching it.

An observer may ask for attention statistics (computed for every request, whatever the policy asks; the
policy still sees only what *it* asked for), and is called with each step's logits and statistics. It must
not change what the engine computes. Each tool builds the core it needs with its observers
(``Engine.make_core``) instead of flipping attributes on a live one.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from trtkv.policies.base import StatsRequest, StepStats

if TYPE_CHECKING:
    from trtkv.runtime.request import GenerationResult, Request


class EngineObserver:
    """Base observer: every hook is a no-op. Subclass and override what you need."""

    def phase_clock(self) -> PhaseClock | None:
        """A clock the core should run through each decode step (``StepProfiler``); None: no timing at all."""
        return None

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


# --- decode-step profile (``trtkv bench --profile``) ---------------------------------------------
PROFILE_PHASES = ("model", "attention", "kv_write", "policy", "bookkeeping")
"""model: embedding, QKV + RoPE, output projection, norms, MLP, logits. attention: the paged-attention kernel,
residual-buffer attention and the log-sum-exp merge. kv_write: the kv_write kernel (write-through and flush).
policy: the policy's hooks (scoring, eviction decisions, k-means) and the attention statistics it asked for.
bookkeeping: everything else (block tables, validity words, slot allocation, eviction bookkeeping, buffers,
sampling, detokenization, stop strings)."""


class PhaseClock:
    """Wall time of one decode step split into ``PROFILE_PHASES``.

    The core and cache call ``switch(phase)`` where work of another kind begins; the time since the previous
    switch goes to the phase that was running. ``switch`` returns that phase so a nested region restores it
    (eviction bookkeeping inside a policy hook goes back to "policy"). On CUDA every switch synchronises,
    or kernel time would land in whatever phase happens to wait for it. Outside a decode step it is idle."""

    __slots__ = ("totals", "current", "running", "_t", "_cuda")

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.totals = dict.fromkeys(PROFILE_PHASES, 0.0)
        self.current = "bookkeeping"
        self.running = False
        self._t = 0.0
        self._cuda = torch.device(device).type == "cuda"

    def start(self) -> None:
        self._sync()
        self.current, self.running, self._t = "bookkeeping", True, time.perf_counter()

    def switch(self, phase: str) -> str:
        prev = self.current
        if self.running:
            self._sync()
            now = time.perf_counter()
            self.totals[prev] += now - self._t
            self._t = now
            self.current = phase
        return prev

    def stop(self) -> None:
        self.switch("bookkeeping")
        self.running = False

    def take(self) -> dict[str, float]:
        """The seconds per phase accumulated since the last ``take``, and reset."""
        out, self.totals = self.totals, dict.fromkeys(PROFILE_PHASES, 0.0)
        return out

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()


class StepProfiler(EngineObserver):
    """Splits every decode step into ``PROFILE_PHASES``. The caller times the step itself (the bench's
    scheduler timer) and hands that time to ``step_parts``: bookkeeping is the residual, so the parts add up
    to the measured step time exactly."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.clock = PhaseClock(device)

    def phase_clock(self) -> PhaseClock:
        return self.clock

    def step_parts(self, step_s: float) -> dict[str, float]:
        """Seconds per phase of the step just measured as ``step_s``."""
        parts = self.clock.take()
        timed = sum(v for k, v in parts.items() if k != "bookkeeping")
        parts["bookkeeping"] = step_s - timed
        return parts
