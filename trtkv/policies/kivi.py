"""KIVI: tuning-free asymmetric 2-bit quantization of the KV cache (Liu et al., ICML 2024, arXiv:2402.02750).

Keys are quantized per channel and values per token, both asymmetric (zero point + scale), in groups;
the most recent tokens stay in full precision in a residual buffer until a whole group can be quantized.
Nothing is evicted.

Parameters
    bits    2 (KIVI-2, the paper's headline) or 4 (KIVI-4): selects the trtkv storage format int2 / int4

Choices where the paper is not specific / differences forced by trtkv's formats
    * The int2/int4 formats fix the group at 16 tokens for keys (per channel) and 16 channels for values
      (per token); the paper's default is G = 32 with a residual of R = 128 tokens. The runtime's residual
      buffer therefore holds at most 16 full-precision tokens (fp16 on CPU-fp32 engines, the engine dtype
      otherwise) and flushes them as one quantized group when full.
    * The prompt's last ``len % 16`` tokens stay in the residual buffer (KIVI keeps the tail full precision).
    * ``budget`` must stay unset: KIVI never evicts.
"""
from __future__ import annotations

from dataclasses import dataclass

from trtkv.policies.base import KVPolicy


@dataclass
class KIVIPolicy(KVPolicy):
    name = "kivi"
    description = "asymmetric 2/4-bit KV (keys per channel, values per token) + fp16 residual (Liu et al. 2024)"
    bits: int = 2

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4; got {self.bits}")
        fmt = f"int{self.bits}"
        if self.kv_format not in ("auto", fmt):
            raise ValueError(f"kivi fixes its storage format ({fmt} with bits={self.bits}; int4 with bits=4), so "
                             f"kv_format={self.kv_format} is not accepted; choose bits=2 or bits=4 instead")
        self.kv_format = fmt
        if self.budget is not None:
            raise ValueError("kivi quantizes and never evicts; build it without --budget")

    def flush_prompt_tail(self) -> bool:
        return False
