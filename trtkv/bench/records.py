"""What a bench sweep runs (``BenchConfig``) and what one engine x batch size x repeat measured
(``RunResult``): the runner fills them, the summary reads them."""
from __future__ import annotations

from dataclasses import dataclass, field

from trtkv.errors import TrtkvError


@dataclass
class BenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    gen_len: int = 256
    kv_memory: int | None = None  # bytes, for the "largest batch that fits" estimate
    repeat: int = 1
    warmup: bool = True
    prompt_source: str = "text"  # "text": packaged reasoning traces tokenized and repeated; "ids": random ids
    seed: int = 0
    profile: bool = False  # split every decode step into PROFILE_PHASES (runtime/observers.py::StepProfiler)

    def validate(self) -> "BenchConfig":
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise TrtkvError(f"--batch-sizes must be positive integers, got {list(self.batch_sizes)}")
        if self.prompt_len <= 0 or self.gen_len <= 0:
            raise TrtkvError("--prompt-len and --gen-len must be positive")
        if self.repeat <= 0:
            raise TrtkvError("--repeat must be at least 1")
        if self.prompt_source not in ("text", "ids"):
            raise TrtkvError("--prompt must be 'text' or 'ids'")
        return self


@dataclass
class RunResult:
    engine: str
    batch: int
    repeat: int
    prefill_s: list[float] = field(default_factory=list)  # per request
    decode_s: list[float] = field(default_factory=list)  # per batched decode step
    step_batch: list[int] = field(default_factory=list)  # requests in each decode step
    step_kv_total: list[int] = field(default_factory=list)  # KV bytes of all running requests after each step
    e2e_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    kv_bytes_end: list[int] = field(default_factory=list)
    kv_bytes_peak: list[int] = field(default_factory=list)
    kv_bytes_full: list[int] = field(default_factory=list)
    live_tokens: list[int] = field(default_factory=list)
    evicted_tokens: list[int] = field(default_factory=list)
    trace: list[tuple[int, int]] = field(default_factory=list)  # (generated tokens, KV bytes) of request 0
    policy_stats: list[dict[str, float]] = field(default_factory=list)  # per request: the policy's numeric stats
    tier_stats: list[dict[str, float]] = field(default_factory=list)  # per request: the cache's per-tier numbers
    peak_device_bytes: int | None = None
    pool_bytes: int = 0  # the pools' preallocated capacity
    pool_peak_bytes: int = 0  # pages and key-scale groups in use at once, at most, during the run
    rss_bytes: int | None = None
    profile_s: dict[str, list[float]] = field(default_factory=dict)  # --profile: per phase, per decode step
