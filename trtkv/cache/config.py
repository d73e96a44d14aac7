"""Cache settings: ``CacheConfig`` (what one KV cache is built with) and the one validator of the
user-settable settings (``--set``, ``engine.json``'s cache section, load-time overrides)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trtkv.errors import TrtkvError
from trtkv.sizes import parse_size

EVICTION_MODES = ("inplace", "compact")
MAX_BLOCK_SIZE = 31  # a page's validity bits fit one int32 word


@dataclass
class CacheConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 8
    residual_group: int = 1  # g: tokens held in full precision before a quantized flush (1 = write-through)
    residual_dtype: torch.dtype = torch.float16
    eviction: str = "inplace"  # "inplace": CT slot reuse; "compact": gather live tokens together (R-KV style)
    max_pages: int | None = None  # pages of every (layer, format) pool; None: sized from kv_memory
    initial_pages: int = 8  # host-tier pools' first size (they grow; device pools are sized once)
    device: str = "cpu"
    kv_memory: int | None = None  # device KV bytes (pools, admission); None = a default (cache/budget.py)
    kv_memory_fraction: float = 0.9  # CUDA, kv_memory unset: this share of the free device memory
    max_batch: int = 64  # residual buffers set aside before the pools are sized (the scheduler's batch)
    # key-scale groups per page of a token-dropping policy's arena; None: one per slot, which page reservations
    # alone guarantee. Set (``trtkv bench --requests``, from the workload), admission reserves groups too.
    key_groups_per_page: float | None = None
    # --- tiered memory (trtkv/cache/tiers.py) ---
    demote: str = "none"  # a policy's evictions: "none" drop (T3), "host" move to T1, "host-<format>" to T2
    host_kv_memory: int | None = None  # host tiers' bytes cap; None = unbounded

    def __post_init__(self) -> None:
        self.validate_settings({"block_size": self.block_size, "eviction": self.eviction,
                                "max_pages": self.max_pages, "kv_memory": self.kv_memory,
                                "kv_memory_fraction": self.kv_memory_fraction, "max_batch": self.max_batch,
                                "demote": self.demote, "host_kv_memory": self.host_kv_memory})

    @staticmethod
    def validate_settings(settings: dict[str, Any]) -> dict[str, Any]:
        """The one validator of user-settable cache settings (``--set``, ``engine.json``'s cache section,
        load-time overrides): ``block_size``, ``eviction``, ``max_pages``, ``kv_memory`` (bytes or a size
        like ``2GiB``), ``kv_memory_fraction`` (0 < f <= 1) and the scheduler's ``max_batch``. Strings are
        parsed; returns typed values, raises one ``TrtkvError`` line naming the setting."""
        out: dict[str, Any] = {}
        for key, value in settings.items():
            if key not in CACHE_SETTINGS:
                raise TrtkvError(f"unknown cache setting {key!r}; cache settings are {', '.join(CACHE_SETTINGS)}")
            out[key] = _cache_setting(key, value)
        return out


CACHE_SETTINGS = ("block_size", "eviction", "max_batch", "max_pages", "kv_memory", "kv_memory_fraction", "demote",
                  "host_kv_memory")


def _cache_setting(key: str, value: Any) -> Any:
    def bad(why: str) -> TrtkvError:
        return TrtkvError(f"cache setting {key}={value!r}: {why}")

    text = value.strip().lower() if isinstance(value, str) else value
    if key == "eviction":
        if text not in EVICTION_MODES:
            raise bad(f"choose {' or '.join(EVICTION_MODES)}")
        return text
    if key == "demote":
        from trtkv.cache.tier_names import parse_demote

        parse_demote(text)  # a bad value fails here, with one clear line
        return text
    if key == "kv_memory_fraction":
        try:
            f = float(text) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            raise bad("expected a fraction of the free device memory, 0 < f <= 1 (e.g. 0.9)") from None
        if not 0 < f <= 1:
            raise bad("expected a fraction of the free device memory, 0 < f <= 1 (e.g. 0.9)")
        return f
    if key in ("max_pages", "kv_memory", "host_kv_memory") and text in (None, "none", "null", "auto"):
        return None
    if key in ("kv_memory", "host_kv_memory"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad("expected a size in bytes, e.g. 2GiB or 512MiB")
        try:
            return parse_size(value)
        except TrtkvError as e:
            raise bad(str(e)) from None
    if isinstance(value, str):
        try:
            value = int(text)
        except ValueError:
            raise bad("expected a whole number") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad("expected a whole number")
    if key == "block_size" and not 1 <= value <= MAX_BLOCK_SIZE:
        raise bad(f"must be between 1 and {MAX_BLOCK_SIZE}")
    if value < 1:
        raise bad("must be positive")
    return value
