"""``--set KEY=VALUE`` settings: parsed once, then split into cache settings and policy parameters.

One module below every command that takes ``--set`` (``build``, ``generate``, ``bench``, ``eval``, ``export``),
so a key means the same everywhere: a key in ``CACHE_SETTINGS`` goes to the cache (``CacheConfig`` validates
and types it), any other key to the policy."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from trtkv.cache.config import CACHE_SETTINGS
from trtkv.errors import TrtkvError

V = TypeVar("V")


def parse_sets(values: Iterable[str]) -> dict[str, str]:
    """``("budget=256", "kv_memory=2GiB")`` -> ``{"budget": "256", "kv_memory": "2GiB"}``; a later key wins."""
    out = {}
    for item in values:
        if "=" not in item:
            raise TrtkvError(f"--set {item!r}: expected key=value")
        k, v = item.split("=", 1)
        if not k.strip():
            raise TrtkvError(f"--set {item!r}: empty key")
        out[k.strip()] = v.strip()
    return out


def split_settings(settings: Mapping[str, V]) -> tuple[dict[str, V], dict[str, V]]:
    """``(policy parameters, cache settings)``: the keys in ``CACHE_SETTINGS`` go to the cache."""
    policy = {k: v for k, v in settings.items() if k not in CACHE_SETTINGS}
    cache = {k: v for k, v in settings.items() if k in CACHE_SETTINGS}
    return policy, cache
