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

from trtkv.cache.budget import groups_needed, pages_needed, plan_pools
from trtkv.cache.config import CacheConfig
from trtkv.errors import OutOfKVMemory, TrtkvError

MAX_BATCH_SEARCHED = 1 << 16


@dataclass(frozen=True)
class Capacity:
    batch: int  # requests admission runs at once in ``kv_memory``
    pool_pages: int  # pages of each (layer, format) pool at that batch
    pages_per_request: dict[str, int]  # worst-case pages one request reserves in each format's pool
    key_groups_per_page: float | None = None  # the arenas' density this workload needs (None: one group a slot)


def workload_groups_per_page(policy, cfg: CacheConfig, prompt_len: int, gen_len: int) -> float | None:
    """Key-scale groups per page that requests of this shape can need at most (``groups_needed`` over
    ``pages_needed``), when below a token-dropping policy's one group per slot; else None."""
    if not policy.drops_tokens():
        return None
    pages = pages_needed(policy, cfg, prompt_len, gen_len)
    groups = groups_needed(policy, cfg, prompt_len, gen_len)
    ratios = [groups[f] / pages[f] for f in groups if pages.get(f)]
    return max(ratios) if ratios and max(ratios) < cfg.block_size else None


def largest_batch(policy, cfg: CacheConfig, prompt_len: int, gen_len: int) -> Capacity:
    """The largest batch of ``prompt_len + gen_len``-token requests admission runs at once in ``cfg.kv_memory``,
    with key-scale arenas as dense as these requests can need (admission then reserves groups too); a memory
    that cannot hold even one is one clear error."""
    if cfg.kv_memory is None:
        raise TrtkvError("the largest batch that fits needs a KV memory: pass --kv-memory SIZE")
    density = workload_groups_per_page(policy, cfg, prompt_len, gen_len)
    cfg = dataclasses.replace(cfg, key_groups_per_page=density)
    need = pages_needed(policy, cfg, prompt_len, gen_len)
    need_groups = groups_needed(policy, cfg, prompt_len, gen_len) if density is not None else {}

    def admitted(batch: int) -> tuple[int, int]:
        c = dataclasses.replace(cfg, max_batch=batch)
        try:
            plan = plan_pools(c, policy.pool_formats(), policy.drops_tokens())
        except OutOfKVMemory:
            return 0, 0
        fits = [plan.pages // n for n in need.values()] + [plan.groups(f, c) // n for f, n in need_groups.items()]
        return min(fits) if fits else batch, plan.pages

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
    return Capacity(lo, admitted(lo)[1], need, density)
