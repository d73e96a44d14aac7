"""StreamingLLM (Xiao et al., 2023): attention sinks plus a recent window, evicting in place.

The cache holds the first ``n_sink`` tokens and the most recent ``budget - n_sink``. Room for the
incoming token is made *before* each step, so the cache never holds more than ``budget`` tokens and a
new token lands in the slot its predecessor freed (no new pages once the window is full).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trtkv.policies.base import KVPolicy


@dataclass
class StreamingLLMPolicy(KVPolicy):
    name = "streamingllm"
    description = "attention sinks + recent window (Xiao et al. 2023)"
    budget: int | None = 256
    n_sink: int = 4

    def __post_init__(self) -> None:
        if self.budget is None or self.budget <= self.n_sink:
            raise ValueError(f"streamingllm needs budget > n_sink ({self.n_sink})")

    def _victims(self, req, room: int):
        """The positions to drop so ``room`` more tokens fit: everything between the sinks and the window."""
        keep_recent = self.budget - self.n_sink - room
        live = req.live_positions(0)
        if len(live) + room <= self.budget:
            return live[:0]
        return live[self.n_sink: len(live) - keep_recent] if keep_recent > 0 else live[self.n_sink:]

    def on_prefill_end(self, req, stats) -> None:
        req.evict_all_layers(self._victims(req, 0))

    def on_decode_step_begin(self, req) -> None:
        req.evict_all_layers(self._victims(req, 1))

    def on_decode_step_begin_batch(self, reqs) -> None:
        """The batch's window slides together: each layer's victims (one a request once the window is full) are
        evicted in one call for the batch."""
        if not reqs:
            return
        first, layers = reqs[0], np.arange(reqs[0].num_layers)
        held = first.num_paged_many(0, reqs)
        due = np.flatnonzero(held + 1 > self.budget)
        if not len(due):  # (the window still filling)
            return
        if (held[due] == self.budget).all():
            # the steady window: one victim a request, its oldest past the sinks, read for the batch at once; every
            # layer at once
            victims = first.live_positions_each(0, reqs, due, self.budget)[:, self.n_sink]
            at = np.broadcast_to(victims, (len(layers), len(victims)))
            first.evict_each_layers(layers, [reqs[i] for i in due.tolist()], at)
            return
        jobs = [(req, v) for req in reqs if len(v := self._victims(req, 1))]
        if not jobs:
            return
        for layer in layers.tolist():
            first.evict_many(layer, jobs)
