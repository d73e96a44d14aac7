"""Admission by device memory: what a request costs on the device at worst, and the one-line errors when it
cannot fit even alone — in bytes against ``--kv-memory`` and in pages against the preallocated pools
(``trtkv/cache/budget.py``; the scheduler reserves the same pages while requests run). Host tiers
(``trtkv/cache/tiers.py``) do not count: tiering and ``demote`` shrink a policy's device footprint
(``KVPolicy.kv_footprint``), so more requests fit."""
from __future__ import annotations

from plugins.formats import get_format
from trtkv.cache.manager import CacheConfig
from trtkv.errors import OutOfKVMemory


def device_bytes_per_token(cfg: CacheConfig, fmt: str) -> float:
    """Device bytes one token costs in all layers in ``fmt`` (page share incl. metadata, key-scale groups)."""
    f = get_format(fmt)
    H, D, B = cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    meta = 4 + 1 + (4 * B if f.group_fields(H, D) else 0) + 4
    group = f.group_bytes(H, D) / f.group_size if f.group_fields(H, D) else 0.0
    return cfg.num_layers * (f.slot_bytes(H, D) + meta / B + group)


def device_bytes_needed(policy, cfg: CacheConfig, prompt_len: int, max_tokens: int) -> int:
    """Worst-case device KV bytes of one request (admission by device memory, ``--kv-memory``)."""
    total = sum(device_bytes_per_token(cfg, f) * n for f, n in policy.kv_footprint(prompt_len, max_tokens).items())
    if cfg.residual_group > 1:
        total += 2 * cfg.num_layers * cfg.residual_group * cfg.num_kv_heads * cfg.head_dim * 2
    return int(total)


def check_device_cap(policy, cfg: CacheConfig, prompt_len: int, max_tokens: int) -> None:
    """One clear error when a request cannot fit the device KV cap (``--kv-memory``) even alone."""
    cap = getattr(cfg, "kv_memory", None)
    if cap is None:
        return
    fmt = max(policy.formats(), key=lambda f: get_format(f).slot_bytes(cfg.num_kv_heads, cfg.head_dim))
    protected = policy.min_device_tokens(prompt_len, max_tokens)  # None: no protected set (only tiered has one)
    if protected is not None and (must := int(protected * device_bytes_per_token(cfg, fmt))) > cap:
        raise OutOfKVMemory(f"this request can never fit the KV cache: --kv-memory {cap:,} bytes is smaller than "
                            f"its protected set on the device ({protected} tokens of the {prompt_len}-token "
                            f"prompt, sinks and recent window = {must:,} bytes); raise --kv-memory or shorten "
                            f"the prompt")
    need = device_bytes_needed(policy, cfg, prompt_len, max_tokens)
    if need > cap:
        raise OutOfKVMemory(f"this request can never fit the KV cache: it needs up to {need:,} device KV bytes "
                            f"({prompt_len} prompt + {max_tokens} new tokens) but --kv-memory is {cap:,}; raise "
                            f"--kv-memory, lower --max-tokens, or keep fewer tokens on the device (e.g. tiered "
                            f"with a lower beta, or demote=host)")


def check_fits(core, prompt_len: int, max_tokens: int, n: int = 1) -> None:
    """Refuse at once (``OutOfKVMemory``) a request that could never fit ``core``'s KV cache, even alone: its
    protected set or worst case over ``--kv-memory``, or its worst-case pages (``n`` samples) over a pool."""
    from trtkv.cache.budget import never_fits_message, pages_needed

    cfg = core.cache.cfg
    check_device_cap(core.policy, cfg, prompt_len, max_tokens)
    for fmt, pages in pages_needed(core.policy, cfg, prompt_len, max_tokens).items():
        cap = core.cache.capacity_pages(fmt)
        if pages * n > cap:
            raise OutOfKVMemory(never_fits_message(prompt_len, max_tokens, n, fmt, pages * n, cap, cfg))
