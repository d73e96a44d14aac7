"""Search settings (not policy settings): branching, depth, expansion budget, block length, sampling."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trtkv.errors import TrtkvError


@dataclass
class SearchConfig:
    branching: int = 3  # most children per node
    depth: int = 6  # deepest block (the root prompt is depth 0)
    expansions: int = 64  # N_expand: generated blocks per problem (one expansion = one child)
    node_tokens: int = 128  # T_node: most tokens per block
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    chat: bool = False  # wrap the problem in the model's chat template (off: its system prompt is pinned root)
    stop_on_solution: bool = True  # stop when the task verifies a solution without the reference (game24)

    @classmethod
    def preset(cls, name: str, **overrides) -> "SearchConfig":
        """The spec's Config-S (3/6/64/128) and Config-L (5/8/256/128)."""
        presets = {"S": dict(branching=3, depth=6, expansions=64, node_tokens=128),
                   "L": dict(branching=5, depth=8, expansions=256, node_tokens=128)}
        if name not in presets:
            raise TrtkvError(f"unknown search preset {name!r}; choose S or L")
        return cls(**{**presets[name], **overrides}).validate()

    def validate(self) -> "SearchConfig":
        for key in ("branching", "depth", "expansions", "node_tokens"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TrtkvError(f"search setting {key} must be a positive integer, got {v!r}")
        if not 0.0 <= self.temperature <= 100 or not 0.0 < self.top_p <= 1.0:
            raise TrtkvError("search temperature must be in [0, 100] and top_p in (0, 1]")
        return self

    def replace(self, **kw) -> "SearchConfig":
        return dataclasses.replace(self, **kw).validate()

    @property
    def max_tokens(self) -> int:
        """The largest tree the search can build, in generated tokens (the capacity budget basis)."""
        return self.expansions * self.node_tokens
