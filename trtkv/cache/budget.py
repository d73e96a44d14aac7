"""How the KV memory becomes page pools — once, when the cache is first used — and what one request
reserves of them.

**The budget.** ``kv_memory`` (``--kv-memory``, ``--set kv_memory=``) when given. Otherwise, on CPU,
``DEFAULT_CPU_KV_MEMORY`` (2 GiB): the pools are ``torch.empty`` tensors initialised page by page as they
are first used, so the pages a run never touches cost address space, not memory (with
``vm.overcommit_memory=2`` set ``--kv-memory``). Address space is not free either: a process whose
reserved pools pass the machine's RAM can no longer ``fork`` (the kernel accounts the merged mapping), so
the default never reserves more than the engine could ever use — ``max_batch`` requests each at the model's
full context (``useful_pages``; a tiny model or a budgeted policy needs far less than 2 GiB).
On CUDA, ``kv_memory_fraction`` (default 0.9, like vLLM's ``gpu_memory_utilization`` but of the memory
*free* when the pools are allocated — the weights are already loaded) of the device memory free then,
counting the caching allocator's unused blocks as free.

**Residual buffers** (the ``g`` newest tokens per layer a quantizing policy holds in fp16 before a flush) are
per request, allocated at admission: ``max_batch`` of them are set aside before the pools are sized.

**The split.** Every layer gets the same pools (admission bounds every layer by the policy's largest
per-layer footprint, so a layer-skewed split would only strand pages). Every format the policy stores
(``KVPolicy.pool_formats()``, e.g. ThinKV's R/E/T formats) gets the same number of pages ``P``: a
multi-format footprint (``kv_footprint``) bounds each format by the same worst case (any thought type may
dominate a request), so reservations need equal page counts, not equal bytes. Hence
``P = pool_bytes / (layers x sum over formats of one page's cost)``.

**Key-scale groups** (per flush group, refcounted by the slots pointing at them; ``plugins/formats/base.py``).
A group lives while one of its slots is live, so groups in use never exceed live slots. For a policy that
may drop tokens (``KVPolicy.drops_tokens``: eviction, demotion, tree pruning) evictions can thin every group
to one live token, so the arena holds one group per slot (``B`` per page) — the only bound that cannot run
out. A policy that keeps every token writes at most ``ceil(tokens / g) + 1`` groups per request against
``ceil(tokens / B) + 2`` reserved pages, so ``max(1, B / g)`` groups per page cannot run out either.
Either way page reservation alone guarantees groups.

**max_pages** caps the pages of every pool; set alone, it sizes them (``kv_memory`` then only reports).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plugins.formats import get_format
from trtkv.errors import OutOfKVMemory

DEFAULT_CPU_KV_MEMORY = 2 << 30
DEFAULT_KV_MEMORY_FRACTION = 0.9


def residual_bytes(cfg) -> int:
    """Device bytes of one request's residual buffer (K and V, every layer); 0 for write-through."""
    if cfg.residual_group <= 1:
        return 0
    elem = torch.empty(0, dtype=cfg.residual_dtype).element_size()
    return 2 * cfg.num_layers * cfg.residual_group * cfg.num_kv_heads * cfg.head_dim * elem


def free_device_bytes(device: torch.device) -> int:
    """Memory a new allocation on ``device`` can get: the driver's free bytes plus the caching allocator's
    reserved-but-unused blocks."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def resolve_kv_memory(cfg) -> int:
    """The bytes the cache may hold on its device (pools + residual buffers)."""
    if cfg.kv_memory is not None:
        return int(cfg.kv_memory)
    device = torch.device(cfg.device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(cfg.kv_memory_fraction * free_device_bytes(device))
    return DEFAULT_CPU_KV_MEMORY


def groups_per_page(fmt: str, cfg, drops_tokens: bool) -> float:
    """Key-scale groups each page of ``fmt`` brings to its pool's arena (0 for formats without one)."""
    f = get_format(fmt)
    if not f.group_fields(cfg.num_kv_heads, cfg.head_dim):
        return 0.0
    if not drops_tokens:
        return max(1.0, cfg.block_size / f.group_size)
    if cfg.key_groups_per_page is not None:  # admission reserves groups as well (``groups_needed``)
        return min(float(cfg.block_size), float(cfg.key_groups_per_page))
    return float(cfg.block_size)


def groups_needed(policy, cfg, prompt_len: int, max_tokens: int) -> dict[str, int]:
    """Key-scale groups one request may hold at worst in each (layer, format) arena: never more than the slots
    of its reserved pages, nor more than the groups it writes — one per flush of ``g`` tokens, prompt and
    generation apart, plus a flushed prompt tail (groups are made only by writes; evictions and gather
    compaction only drop or move references). Host tiers re-make groups for restored tokens, so with
    demotion the slot bound stands. Empty for formats without an arena."""
    g = cfg.residual_group
    out = {}
    for f, pages in pages_needed(policy, cfg, prompt_len, max_tokens).items():
        if not get_format(f).group_fields(cfg.num_kv_heads, cfg.head_dim):
            continue
        slots = pages * cfg.block_size
        written = -(-prompt_len // g) + -(-max_tokens // g) + 2 if g > 1 and cfg.demote == "none" else slots
        out[f] = min(slots, written)
    return out


def page_cost(fmt: str, cfg, drops_tokens: bool) -> float:
    """Device bytes one page of ``fmt`` costs in one layer: codes and scales, its key-group indices, its
    validity word, and its share of the key-scale arena. (Host-side bookkeeping, ~13 bytes a slot, is not
    counted: on a GPU it is not device memory.)"""
    f = get_format(fmt)
    H, D, B = cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    return B * f.slot_bytes(H, D) + 4 * B + 4 + groups_per_page(fmt, cfg, drops_tokens) * f.group_bytes(H, D)


@dataclass(frozen=True)
class PoolPlan:
    """The size of every device pool: ``pages`` in each (layer, format) pool, and its arena's groups."""

    pages: int
    budget: int  # bytes the plan was cut from (kv_memory or the default); 0 when max_pages alone sized it
    drops_tokens: bool
    formats: tuple[str, ...] | None  # None: pools are made on first use, each of max_pages pages

    def groups(self, fmt: str, cfg) -> int:
        return math.ceil(self.pages * groups_per_page(fmt, cfg, self.drops_tokens))

    def device_bytes(self, cfg) -> int:
        """Bytes the planned pools take on the device (every layer, every format)."""
        return int(cfg.num_layers * self.pages * sum(page_cost(f, cfg, self.drops_tokens) for f in self.formats or ()))


def plan_pools(cfg, formats, drops_tokens: bool = True, useful_pages: int | None = None) -> PoolPlan:
    """Pages per pool from ``kv_memory`` (or its default) and ``max_pages``; see the module docstring.
    ``useful_pages`` (the most pages a pool could ever hold) caps the default budget, not an explicit one."""
    fmts = tuple(sorted(formats)) if formats is not None else None
    if fmts is None or (cfg.max_pages is not None and cfg.kv_memory is None):
        if cfg.max_pages is None:
            raise OutOfKVMemory("the KV cache needs the formats it stores (to split kv_memory among them) or "
                                "max_pages")
        return PoolPlan(cfg.max_pages, 0, drops_tokens, fmts)
    budget = resolve_kv_memory(cfg)
    pool_bytes = budget - cfg.max_batch * residual_bytes(cfg)
    per_page = cfg.num_layers * sum(page_cost(f, cfg, drops_tokens) for f in fmts)
    pages = int(max(0, pool_bytes) // per_page)
    if cfg.max_pages is not None:
        pages = min(pages, cfg.max_pages)
    elif cfg.kv_memory is None and useful_pages is not None:
        pages = min(pages, max(1, useful_pages))
    if pages < 1:
        reserve = cfg.max_batch * residual_bytes(cfg)
        raise OutOfKVMemory(f"KV memory of {budget:,} bytes cannot hold one page per layer and format ("
                            f"{int(per_page):,} bytes for {cfg.num_layers} layers x {', '.join(fmts)}"
                            + (f", after {reserve:,} bytes of residual buffers for max_batch={cfg.max_batch}"
                               if reserve else "") + "); raise --kv-memory")
    return PoolPlan(pages, budget, drops_tokens, fmts)


def useful_pages(policy, cfg, max_context: int) -> int:
    """The most pages one pool could ever hold: ``max_batch`` requests, each at ``max_context`` tokens."""
    need = pages_needed(policy, cfg, max(1, max_context - 1), 1)
    return cfg.max_batch * max(need.values(), default=1)


def pages_needed(policy, cfg, prompt_len: int, max_tokens: int) -> dict[str, int]:
    """Pages one request may hold at worst in each (layer, format) pool: its footprint in pages plus two
    per format the policy writes (a class's open page and a page sealed by a fork)."""
    slack = 2 * len(policy.formats())
    return {f: math.ceil(n / cfg.block_size) + slack
            for f, n in policy.kv_footprint(prompt_len, max_tokens).items()}


def never_fits_message(prompt_len: int, max_tokens: int, n: int, fmt: str, need: int, cap: int, cfg,
                       unit: str = "pages") -> str:
    """The one line for a request whose worst-case pages (or key-scale groups: ``unit``; ``need``, ``n`` samples)
    exceed a ``fmt`` pool's ``cap`` (admission at ``Engine.make_request`` and the scheduler's)."""
    samples = f" x {n} samples" if n > 1 else ""
    size = (f"kv_memory {cfg.kv_memory:,} bytes" if cfg.kv_memory is not None else
            f"max_pages={cfg.max_pages}" if cfg.max_pages is not None else "the default KV memory")
    return (f"this request can never fit the KV cache: it may need {need} {unit} of {fmt} per layer ({prompt_len} "
            f"prompt + {max_tokens} new tokens{samples}) but each pool holds {cap} ({size}); raise --kv-memory "
            f"(or --set max_pages), lower --max-tokens or shorten the prompt")
