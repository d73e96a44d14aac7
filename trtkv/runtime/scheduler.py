"""Continuous batching: admit waiting requests (by batch slots and free KV pages), prefill them, run one
batched decode step over everything running, and free a finished request's pages at once."""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import torch

from trtkv.runtime.core import EngineCore
from trtkv.runtime.forking import spawn_samples
from trtkv.runtime.request import Request


class Scheduler:
    def __init__(self, core: EngineCore, max_batch: int = 64,
                 step_timer: Callable[[str, list[Request], float], None] | None = None):
        self.core = core
        self.max_batch = max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # ``trtkv bench``: called as (phase "prefill" | "decode", requests, seconds) after each timed call,
        # device-synchronised; None (the default) times nothing.
        self.step_timer = step_timer

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, req: Request) -> int:
        core = self.core
        toks = core.policy.max_live_tokens(req.prompt_len, req.max_new)
        return math.ceil(toks / core.cache.cfg.block_size) + 2 * len(core.policy.formats())

    def _can_admit(self, req: Request) -> bool:
        if self.core.cache.cfg.kv_memory is not None and not self._fits_device(req):
            return False
        max_pages = self.core.cache.cfg.max_pages
        if max_pages is None:
            return True
        reserved = sum(self._pages_needed(r) for r in self.running)
        return reserved + self._pages_needed(req) <= max_pages or not self.running

    def _fits_device(self, req: Request) -> bool:
        """Admission by device KV bytes (``--kv-memory``): the running requests' worst-case device footprints
        plus this one's fit the cap (a request alone is always admitted; ``Engine.make_request`` has already
        rejected one that cannot fit even alone). Tiering and demotion shrink footprints, so more run at once."""
        from trtkv.cache.admission import device_bytes_needed

        core = self.core
        need = [device_bytes_needed(core.policy, core.cache.cfg, r.prompt_len, r.max_new) for r in self.running]
        mine = device_bytes_needed(core.policy, core.cache.cfg, req.prompt_len, req.max_new)
        return not self.running or sum(need) + mine <= core.cache.cfg.kv_memory

    def step(self) -> list[Request]:
        """One scheduler iteration; returns the requests that finished in it (already freed)."""
        done = []
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            r.finish_reason = "cancelled"
            done.append(r)
        while self.waiting and len(self.running) < self.max_batch and self._can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            self._run("prefill", self.core.prefill, req, [req])
            self.running.append(req)
            self.running.extend(spawn_samples(self.core, req))  # SamplingParams(n>1): forked siblings
        active = [r for r in self.running if not r.finished and not r.cancelled]
        if active:
            self._run("decode", self.core.decode_step, active, active)
        still = []
        for r in self.running:
            if r.cancelled and not r.finished:
                r.finish_reason = "cancelled"
            if r.finished:
                self.core.finish(r)
                done.append(r)
            else:
                still.append(r)
        self.running = still
        return done

    def _run(self, phase: str, fn, arg, reqs: list[Request]) -> None:
        if self.step_timer is None:
            fn(arg)
            return
        _sync(self.core.device)
        t0 = time.perf_counter()
        fn(arg)
        _sync(self.core.device)
        self.step_timer(phase, reqs, time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
