"""The tiers' names and the settings that name them (``demote=``, ``host_format=``, the request API's
``place(..., tier)``), parsed into codes for ``trtkv/cache/tiers.py``; ``CacheConfig`` validates with them."""
from __future__ import annotations

from plugins.formats import FORMATS
from trtkv.errors import TrtkvError

TIER_DEVICE, TIER_HOST, TIER_HOST_Q, TIER_EVICTED = 0, 1, 2, 3
TIER_NAMES = ("device", "host", "host-q", "evicted")
# The compressed host format ``demote=host-compressed`` / ``host_format=compressed`` pick. Chosen by measured
# fidelity on the shipped R1 traces (docs/benchmarks.md, "Tiered KV memory"): int4 kept more top-1 agreement
# than nvfp4 at nearly the same bytes.
DEFAULT_HOST_FORMAT = "int4"


def parse_host_format(value: str | None, what: str = "host_format") -> str | None:
    """``none``/empty -> None (T1, the token's own format); ``compressed`` -> the default T2 format; else a
    registered KV format name. Bad values raise one clear line."""
    text = (value or "none").strip().lower()
    if text in ("none", "", "same", "t1"):
        return None
    if text == "compressed":
        return DEFAULT_HOST_FORMAT
    if text not in FORMATS:
        raise TrtkvError(f"{what}={value!r}: not a KV format; choose none, compressed or one of "
                         f"{', '.join(FORMATS)}")
    return text


def parse_demote(value: str | None) -> tuple[bool, str | None]:
    """``demote=none|host|host-<format>`` -> (demote?, host format or None for T1)."""
    text = (value or "none").strip().lower()
    if text == "none":
        return False, None
    if text == "host":
        return True, None
    if text.startswith("host-"):
        return True, parse_host_format(text[5:], what=f"demote={value}: format")
    raise TrtkvError(f"--set demote={value!r}: choose none, host, host-compressed or host-<format> "
                     f"(e.g. host-int4)")


def parse_tier(tier: str) -> tuple[int, str | None]:
    """A tier name of the request API: ``device``, ``host``, ``host-<format>``, ``evicted``."""
    t = tier.strip().lower()
    if t == "device":
        return TIER_DEVICE, None
    if t == "evicted":
        return TIER_EVICTED, None
    if t == "host" or t.startswith("host-"):
        fmt = parse_host_format(t[5:] if t.startswith("host-") else None, what=f"tier {tier!r}: format")
        return (TIER_HOST if fmt is None else TIER_HOST_Q), fmt
    raise TrtkvError(f"unknown tier {tier!r}; choose device, host, host-<format> or evicted")
