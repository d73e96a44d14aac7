"""How many requests fit a KV memory at once: the largest batch the scheduler's admission can run.

Admission (``trtkv/runtime/scheduler.py``) reserves each running request's worst-case pages per format
(``pages_needed``: its ``kv_footprint`` — bounded by an eviction policy's budget, the whole prompt and
generation for ``full`` — plus an open page per format), and the pools are cut from ``kv_memory`` after
``max_batch`` residual buffers are set aside. So the largest batch ``B`` is the largest with
``B x pages_needed[f] <= pages(kv_memory, max_batch=B)`` for every format ``f``; more set-aside buffers
mean fewer pages, so it is found by bisection.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trtkv.cache.budget import pages_needed, plan_pools
from trtkv.cache.config import CacheConfig
from trtkv.errors import OutOfKVMemory, TrtkvError

MAX_BATCH_SEARCHED = 1 << 16


@dataclass(frozen=True)
class Capacity:
    batch: int  # requests admission runs at once in ``kv_memory``
    pool_pages: int  # pages of each (layer, format) pool at that batch
    pages_per_request: dict[str, int]  # worst-case pages one request reserves in each format's pool


def largest_batch(policy, cfg: CacheConfig, prompt_len: int, gen_len: int) -> Capacity:
    """The largest batch of ``prompt_len + gen_len``-token requests admission runs at once in ``cfg.kv_memory``;
    a memory that cannot hold even one is one clear error."""
    if cfg.kv_memory is None:
        raise TrtkvError("the largest batch that fits needs a KV memory: pass --kv-memory SIZE")
    need = pages_needed(policy, cfg, prompt_len, gen_len)

    def admitted(batch: int) -> tuple[int, int]:
        c = dataclasses.replace(cfg, max_batch=batch)
        try:
            pages = plan_pools(c, policy.pool_formats(), policy.drops_tokens()).pages
        except OutOfKVMemory:
            return 0, 0
        return min(pages // n for n in need.values()) if need else batch, pages

    lo, hi = 0, MAX_BATCH_SEARCHED
    while lo < hi:  # the largest batch whose own pools admit it
        mid = (lo + hi + 1) // 2
        if admitted(mid)[0] >= mid:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise TrtkvError(f"--kv-memory {cfg.kv_memory:,} bytes cannot hold one request of {prompt_len} + {gen_len} "
                         f"tokens under {policy.name} (it reserves {need} pages per layer and format); raise "
                         f"--kv-memory or shorten the requests")
    return Capacity(lo, admitted(lo)[1], need)
