"""Continuous batching: admit waiting requests (by batch slots and the KV pages they may need), prefill them
(a packed group of prompts a pass, runtime/prefill.py), run one batched decode step over everything running,
and free a finished request's pages at once.

Admission reserves, per format, the pages each running request may still need at worst
(``trtkv/cache/budget.py``'s ``pages_needed``), and the pools ready them before the prefill (no decode step
touches fresh pool memory first): a request whose reservation does not fit *now* waits at the
head of the queue until running requests finish; one that could never fit the pools fails with one clear
``OutOfKVMemory`` line. If a request outgrows its reservation anyway (a policy's bound was too low), the full
pool's ``OutOfKVMemory`` fails that request alone: its pages are freed, the other requests' half-done step is
undone and run again, and the engine goes on.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from trtkv.cache.budget import groups_needed, never_fits_message, pages_needed
from trtkv.distributed.group import RankLost
from trtkv.errors import OutOfKVMemory, TrtkvError
from trtkv.runtime.core import EngineCore
from trtkv.runtime.forking import spawn_samples
from trtkv.runtime.request import Request


# Prompt tokens prefilled in one packed pass: enough to fill the device's matmuls, few enough that the pass's
# activations stay small beside the KV pools (an 8B model's MLP at 8,192 tokens: ~235 MB in bf16).
PREFILL_TOKENS = 8192


class Scheduler:
    def __init__(self, core: EngineCore, max_batch: int = 64,
                 step_timer: Callable[[str, list[Request], float], None] | None = None,
                 prefill_tokens: int = PREFILL_TOKENS):
        self.core = core
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        self.waiting: deque[Request] = deque()
        self._running: list[Request] = []
        # what the running requests reserve, per format, kept as they start and stop (admission reads it per
        # request admitted, so summing over a batch of 1,024 each time would be O(batch^2) per step)
        self._held_pages: Counter[str] = Counter()
        self._held_groups: Counter[str] = Counter()
        # ``trtkv bench``: called as (phase "prefill" | "decode", requests, seconds) after each timed call,
        # device-synchronised; None (the default) times nothing.
        self.step_timer = step_timer

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self._running)

    @property
    def running(self) -> tuple[Request, ...]:
        """The requests decoding now (read-only: they start in ``step`` and stop through it or ``drop_running``)."""
        return tuple(self._running)

    def _start(self, reqs: list[Request]) -> None:
        for r in reqs:
            self._running.append(r)
            self._reserve(r)

    def _reserve(self, r: Request) -> None:
        self._held_pages.update(self.reserved_pages(r))
        self._held_groups.update(self.reserved_groups(r))

    def _stopped(self, r: Request) -> None:
        """``r`` left the running set: its reservations go back."""
        self._held_pages.subtract(self.reserved_pages(r))
        self._held_groups.subtract(self.reserved_groups(r))

    def drop_running(self) -> list[Request]:
        """Stop every running request without finishing it (the caller fails them); returns them."""
        out, self._running = self._running, []
        for r in out:
            self._stopped(r)
        return out

    def drop_waiting(self) -> list[Request]:
        """Forget every waiting request (the caller fails them); returns them."""
        out = list(self.waiting)
        self.waiting.clear()
        return out

    # --- admission ------------------------------------------------------------------------------
    def reserved_pages(self, req: Request) -> dict[str, int]:
        """Pages per (layer, format) pool ``req`` may hold at worst (one sample; computed once)."""
        if req.kv_pages is None:
            core = self.core
            req.kv_pages = pages_needed(core.policy, core.cache.cfg, req.prompt_len, req.max_new)
        return req.kv_pages

    def reserved_groups(self, req: Request) -> dict[str, int]:
        """Key-scale groups per (layer, format) arena ``req`` may hold at worst, where admission reserves
        them (``KVCacheManager.reserves_groups``); else empty (its pages guarantee them)."""
        if req.kv_groups is None:
            core = self.core
            req.kv_groups = (groups_needed(core.policy, core.cache.cfg, req.prompt_len, req.max_new)
                             if core.cache.reserves_groups else {})
        return req.kv_groups

    def _ready_reserved(self, also: Request | None = None) -> None:
        """Have the pools initialise every page (and group) the admitted requests reserved — and ``also``'s, n
        samples — now, at admission, rather than a chunk at a time inside decode steps (on a CPU host that is
        the first touch of the memory: ~0.5 GB/s on a VM)."""
        pages, groups = Counter(self._held_pages), Counter(self._held_groups)
        if also is not None:
            pages.update({f: n * also.params.n for f, n in self.reserved_pages(also).items()})
            groups.update({f: n * also.params.n for f, n in self.reserved_groups(also).items()})
        self.core.cache.prepare(pages, groups)

    def free_pages(self) -> dict[str, int]:
        """Pages per format (of every layer's pool) not reserved by a running request."""
        return self._free(self._held_pages, self.core.cache.capacity_pages)

    def free_groups(self) -> dict[str, int]:
        """Key-scale groups per format (of every layer's arena) not reserved by a running request."""
        return self._free(self._held_groups, self.core.cache.capacity_groups)

    def _free(self, held: Counter, capacity) -> dict[str, int]:
        free = {f: capacity(f) for f in self.core.policy.formats()}
        for f, n in held.items():
            free[f] = free.get(f, capacity(f)) - n
        return free

    def _admission(self, req: Request) -> str | None:
        """``"now"``, ``"later"`` (waits for running requests to finish), or the error of a request that can
        never fit the pools."""
        cache = self.core.cache
        verdict = "now"
        for unit, reserved, capacity, free in (
                ("pages", self.reserved_pages, cache.capacity_pages, self.free_pages),
                ("key-scale groups", self.reserved_groups, cache.capacity_groups, self.free_groups)):
            mine = {f: n * req.params.n for f, n in reserved(req).items()}
            if not mine:
                continue
            for f, n in mine.items():
                cap = capacity(f)
                if n > cap:
                    return never_fits_message(req.prompt_len, req.max_new, req.params.n, f, n, cap, cache.cfg, unit)
            left = free()
            if not all(n <= left.get(f, capacity(f)) for f, n in mine.items()):
                verdict = "later"
        return verdict

    def culprit(self, e: OutOfKVMemory, candidates: list[Request]) -> Request | None:
        """The request to fail for a full pool: the one holding the most pages beyond its reservation in that
        pool (admission reserved every request's worst case, so when a pool fills some request is over), else
        the one that asked."""
        asked = next((r for r in candidates if r.req_id == e.seq_id), None)
        if e.layer is None or e.fmt is None:
            return asked

        def over(r: Request) -> int:
            if r.ctx is None or r.req_id not in self.core.cache.seqs:
                return -1 << 30
            held = len(r.ctx.seq.layers[e.layer].pages_of_format().get(e.fmt, ()))
            return held - self.reserved_pages(r).get(e.fmt, 0)  # (n samples: each reserved one share)

        worst = max(candidates, key=over, default=None)
        return worst if worst is not None and over(worst) > 0 else asked

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One scheduler iteration; returns the requests that finished in it (already freed)."""
        done = []
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            r.finish_reason = "cancelled"
            done.append(r)
        done.extend(self._admit())
        active = [r for r in self._running if not r.finished and not r.cancelled]
        failed = self._decode(active) if active else []
        done.extend(failed)
        gone = {id(r) for r in failed}
        still, finished = [], []
        for r in self._running:
            if id(r) in gone:
                self._stopped(r)
                continue
            if r.cancelled and not r.finished:
                r.finish_reason = "cancelled"
            (finished if r.finished else still).append(r)
        self._running = still
        self.core.finish_many(finished)  # (their pages back in one pass)
        for r in finished:
            self._stopped(r)
        return done + finished

    def _admit(self) -> list[Request]:
        """Admit waiting requests while batch slots and memory allow, prefilling them a packed group at a time
        (up to ``prefill_tokens`` prompt tokens a group); returns the requests that failed (already freed)."""
        done: list[Request] = []
        group: list[Request] = []  # admitted, reserved, not yet prefilled
        tokens = 0
        while self.waiting and len(self._running) + len(group) < self.max_batch:
            verdict = self._admission(self.waiting[0])
            if verdict == "later":
                break
            req = self.waiting.popleft()
            if verdict != "now":
                self.core.abort(req, verdict)
                done.append(req)
                continue
            if req.params.n > 1:  # its forks start with it: alone, after the group
                done.extend(self._prefill_group(group))
                group, tokens = [], 0
                done.extend(self._prefill(req))
                continue
            if group and (tokens + req.prompt_len > self.prefill_tokens or not self.core.packs_prefill):
                done.extend(self._prefill_group(group))
                group, tokens = [], 0
            self._reserve(req)  # (the next admission counts it)
            group.append(req)
            tokens += req.prompt_len
        done.extend(self._prefill_group(group))
        return done

    def _prefill_group(self, group: list[Request]) -> list[Request]:
        """Prefill the reserved ``group`` in one packed pass and start it running; if that fails, take it back and
        prefill its requests one at a time (so a bad or too-large request fails alone, as ``_prefill`` decides)."""
        if group:
            self._ready_reserved()
        if len(group) > 1:
            try:
                self._run("prefill", self.core.prefill_many, group, group)
            except RankLost:
                raise
            except (TrtkvError, torch.OutOfMemoryError):  # e.g. a full pool, or the packed pass's activations
                for r in group:
                    self.core.unprefill(r)
            else:
                self._running.extend(group)
                return []
        for r in group:
            self._stopped(r)
        return [f for r in group for f in self._prefill(r)]

    def _prefill(self, req: Request) -> list[Request]:
        """Prefill ``req`` and start it running; returns the requests that failed instead (already freed): ``req``
        if its prefill fails, or a running request over its reservation that filled the pool (then ``req``'s
        prefill is run again)."""
        failed: list[Request] = []
        self._ready_reserved(req)
        while True:
            try:
                self._run("prefill", self.core.prefill, req, [req])
                samples = spawn_samples(self.core, req)  # SamplingParams(n>1): forked siblings
            except OutOfKVMemory as e:
                blame = self.culprit(e, [*self._running, req])
                if blame is not None and blame is not req and blame in self._running:
                    self.core.unprefill(req)
                    self._running.remove(blame)
                    self._stopped(blame)
                    self.core.abort(blame, str(e))
                    failed.append(blame)
                    continue
                return failed + self._fail_prefill(req, e)
            except RankLost:  # not the request's fault: the tensor-parallel group is gone
                raise
            except TrtkvError as e:  # a bad request: it fails, nothing else does
                return failed + self._fail_prefill(req, e)
            except torch.OutOfMemoryError:  # the prompt's activations did not fit beside the pools: it fails alone
                self.core.unprefill(req)
                return failed + self._fail_prefill(req, TrtkvError(
                    f"request {req.req_id}: device out of memory prefilling its {req.prompt_len} prompt tokens "
                    "beside the KV pools (a smaller --kv-memory leaves more room)"))
            self._start([req, *samples])
            return failed

    def _fail_prefill(self, req: Request, e: Exception) -> list[Request]:
        for r in (req, *req.forks):
            self.core.abort(r, str(e))
        return [req, *req.forks]

    def _decode(self, active: list[Request]) -> list[Request]:
        """One decode step of ``active``; a request that overflows a pool (or holds the most pages beyond its
        reservation when one fills) fails alone and the step is run again for the others. Returns the failed
        requests (already freed)."""
        failed: list[Request] = []
        while active:
            try:
                self._run("decode", self.core.decode_step, active, active)
                break
            except OutOfKVMemory as e:
                blame = self.culprit(e, active)
                if blame is None:
                    raise  # not one request's: the engine fails the batch
                active = [r for r in active if r is not blame]
                self.core.undo_step(active)
                self.core.abort(blame, str(e))
                failed.append(blame)
        return failed

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
