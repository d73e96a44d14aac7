"""Full cache: keep every token (the reference every compressed policy is compared against)."""
from __future__ import annotations

from dataclasses import dataclass

from trtkv.policies.base import KVPolicy


@dataclass
class FullPolicy(KVPolicy):
    name = "full"
    description = "keep every token; optional fixed storage format (kv_format)"
