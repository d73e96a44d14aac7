"""What a bench sweep runs (``BenchConfig``) and what one engine x batch size x repeat measured
(``RunResult``): the runner fills them, the summary reads them."""
from __future__ import annotations

from dataclasses import dataclass, field

from trtkv.errors import TrtkvError
from trtkv.runtime.scheduler import PREFILL_TOKENS


@dataclass
class BenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    gen_len: int = 256
    kv_memory: int | None = None  # bytes: the "largest batch that fits" estimate; with ``requests``, the KV pools
    # the memory-limited run (``requests`` set): that many requests queued per engine, admitted as the KV pools
    # allow and replaced as they finish; ``requests_auto``: instead, this many times the engine's largest batch
    requests: int | None = None
    requests_auto: float | None = None
    # the memory-limited run: stop each engine's run after this many seconds (its steady state is the window
    # reached; requests running then are cut short, those still waiting never ran)
    duration_s: float | None = None
    prefill_tokens: int = PREFILL_TOKENS  # prompt tokens the scheduler packs into one prefill pass (1: one prompt)
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
        if self.prefill_tokens <= 0:
            raise TrtkvError(f"--prefill-tokens {self.prefill_tokens}: expected a positive number of tokens")
        if self.prompt_source not in ("text", "ids"):
            raise TrtkvError("--prompt must be 'text' or 'ids'")
        if self.memory_limited:
            if self.kv_memory is None:
                raise TrtkvError("--requests runs as many requests at once as --kv-memory holds: pass --kv-memory "
                                 "SIZE (e.g. 256MiB)")
            if (self.requests is not None and self.requests <= 0) or (self.requests_auto is not None
                                                                       and self.requests_auto <= 0):
                raise TrtkvError("--requests must be a positive integer or 'auto'")
        if self.duration_s is not None:
            if not self.memory_limited:
                raise TrtkvError("--duration cuts the memory-limited run short: pass it with --requests N|auto")
            if not self.duration_s > 0:
                raise TrtkvError(f"--duration {self.duration_s}: expected a positive number of seconds")
        return self

    @property
    def memory_limited(self) -> bool:
        return self.requests is not None or self.requests_auto is not None


def parse_requests(text: str | None) -> tuple[int | None, float | None]:
    """``--requests``: ``N`` (requests queued per engine) or ``auto`` (twice each engine's largest batch)."""
    if text is None:
        return None, None
    t = str(text).strip().lower()
    if t == "auto":
        return None, 2.0
    try:
        n = int(t)
    except ValueError:
        raise TrtkvError(f"--requests {text!r}: expected a positive integer or 'auto'") from None
    if n <= 0:
        raise TrtkvError(f"--requests {text!r}: expected a positive integer or 'auto'")
    return n, None


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
    program_steps: dict[str, int] | None = None  # --runtime graph: decode steps in the compiled program / eager
    profile_s: dict[str, list[float]] = field(default_factory=dict)  # --profile: per phase, per decode step
    # the memory-limited run: the batch admission allows, and per decode step its end (seconds from the start)
    # and the requests still waiting for admission
    admission_batch: int | None = None
    step_end_s: list[float] = field(default_factory=list)
    step_waiting: list[int] = field(default_factory=list)
    cut_at_s: float | None = None  # --duration: when the run was stopped with requests unfinished
    finished: int = 0  # requests that generated all their tokens
