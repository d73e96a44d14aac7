"""The bench sweep: for every engine and batch size, B requests of ``prompt_len`` tokens each generate
exactly ``gen_len`` tokens (``ignore_eos``) through the engine's own scheduler, which times every
prefill and every batched decode step (``Scheduler.step_timer``, device-synchronised).

Engines are measured in the same process and interleaved per repeat (repeat 0: every batch size of every
engine, then repeat 1, ...), so slow drifts of a shared machine hit all engines alike and the ratios to
the first engine are meaningful.
"""
from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtkv.errors import TrtkvError
from trtkv.sizes import parse_size  # noqa: F401  (re-exported by trtkv.bench)

FIT_METHOD = (
    "largest batch that fits = floor(KV memory / per-request peak KV bytes), where the per-request peak is the "
    "largest `peak_kv_bytes` any request reached in this sweep (prompt_len + gen_len tokens): the cache's own "
    "accounting of pages (codes, scales, page metadata, block-table entries), key-scale groups and residual "
    "buffer at the request's worst moment (with host tiers: `peak_kv_bytes_device`, the device pages plus the "
    "two one-layer staging buffers; host bytes do not count against device memory). It assumes every request "
    "holds its peak at once (conservative for staggered requests) and ignores pool fragmentation and "
    "allocator overhead; `fit_full_fp16` is the same bound for an uncompressed fp16 cache of the same model.")


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
class BenchEngine:
    label: str
    path: Path
    engine: Any  # trtkv.api.Engine

    @property
    def synthetic(self) -> bool:
        return self.engine.manifest.model.synthetic

    def describe(self) -> dict[str, Any]:
        e = self.engine
        mm = e.manifest.model
        return {"label": self.label, "path": str(self.path), "model": mm.alias, "architecture": mm.architecture,
                "dtype": str(e.core.dtype).replace("torch.", ""), "device": str(e.core.device),
                "policy": e.manifest.policy.name, "policy_params": e.policy.params(),
                "synthetic_weights": self.synthetic, "weight_bytes": weight_bytes(e.model),
                "block_size": e.core.cache.cfg.block_size, "residual_group": e.core.cache.cfg.residual_group,
                "runtime": e.runtime}


# --- parsing ----------------------------------------------------------------------------------------
def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(p) for p in str(text).replace(";", ",").split(",") if p.strip())
    except ValueError:
        raise TrtkvError(f"--batch-sizes {text!r}: expected comma-separated integers like 1,8,32") from None
    if not sizes or any(b <= 0 for b in sizes):
        raise TrtkvError(f"--batch-sizes {text!r}: expected positive integers like 1,8,32")
    return tuple(dict.fromkeys(sizes))


# --- engines ----------------------------------------------------------------------------------------
def load_engines(paths: list[Path], device: str | None = None, policy_overrides: dict[str, Any] | None = None,
                 share_weights: bool = True, runtimes: tuple[str, ...] = ("torch",)) -> list[BenchEngine]:
    """Load every engine (checking all paths first, so a typo fails before minutes of loading).

    ``policy_overrides`` (``--set``) go to each engine whose policy has that parameter (so a ThinKV-only
    setting can be passed in a run that also has full engines); a key no engine takes is an error, and a
    value ``@FILE`` is replaced by the file's text. With
    ``share_weights``, engines of the same model, weights and dtype share one model object: one copy of the
    weights exists (what lets several 8B engines share one GPU). Each engine is loaded once per runtime in
    ``runtimes`` (``torch``, ``onnxruntime``), labelled ``LABEL@RUNTIME`` when there are several."""
    from trtkv.api import Engine
    from trtkv.build.engine_dir import read_manifest
    from trtkv.policies import POLICIES, policy_fields

    if not paths:
        raise TrtkvError("name at least one engine directory")
    from trtkv.cache.manager import CACHE_SETTINGS

    manifests = [read_manifest(p) for p in paths]
    overrides = {k: _value_or_file(k, v) for k, v in (policy_overrides or {}).items()}
    cache_ov = {k: overrides.pop(k) for k in list(overrides) if k in CACHE_SETTINGS}  # demote=, kv_memory=, ...
    per_engine, used = [], set()
    for m in manifests:
        cls = POLICIES.get(m.policy.name)
        mine = {k: v for k, v in overrides.items() if cls is not None and k in policy_fields(cls)}
        used |= set(mine)
        per_engine.append(mine or None)
    unused = sorted(set(overrides) - used)
    if unused:
        raise TrtkvError(f"--set {unused[0]}: none of the engines' policies "
                         f"({', '.join(sorted({m.policy.name for m in manifests}))}) has that parameter")
    out: list[BenchEngine] = []
    shared: dict[tuple, Any] | None = {} if share_weights else None
    for lbl, p, ov in zip(_labels(paths), paths, per_engine):
        for rt in runtimes:
            eng = Engine.load(p, device=device, policy_overrides=ov, model_cache=shared, cache_overrides=cache_ov,
                              runtime=rt)
            out.append(BenchEngine(f"{lbl}@{rt}" if len(runtimes) > 1 else lbl, Path(p), eng))
    return out


def _value_or_file(key: str, value: Any) -> Any:
    """``--set key=@FILE`` passes the file's text (e.g. a recorded ThinKV thought schedule)."""
    if not (isinstance(value, str) and value.startswith("@")):
        return value
    path = Path(value[1:]).expanduser()
    try:
        return path.read_text().strip()
    except OSError as e:
        raise TrtkvError(f"--set {key}=@{path}: cannot read the file ({e.strerror or e})") from None


def model_key(engine) -> tuple:
    """Engines with equal keys run the same weights (same model, weights hash or synthetic seed, dtype)."""
    mm = engine.manifest.model
    weights = ("synthetic", mm.synthetic_seed) if mm.synthetic else mm.weights_sha256
    return (mm.alias, weights, str(engine.core.dtype), str(engine.core.device),
            json.dumps(mm.arch.to_dict(), sort_keys=True))


def _labels(paths: list[Path]) -> list[str]:
    names = [Path(p).resolve().name for p in paths]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied embeddings once), less an untied
    input embedding table, of which a step reads only the rows of its tokens."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    emb = model.model.embed_tokens.weight
    lm = getattr(model, "lm_head", None)
    if lm is None or lm.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def machine_info(device: str | None = None) -> dict[str, Any]:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}  # a busy shared machine skews timings
    if device and device.startswith("cuda") or (device is None and torch.cuda.is_available()):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


# --- prompts ----------------------------------------------------------------------------------------
def make_prompts(engine, n: int, length: int, source: str, seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` token ids (different start offsets, so no two are equal)."""
    vocab = engine.arch.vocab_size
    if source == "ids":
        g = torch.Generator().manual_seed(seed)
        hi = min(vocab, 32000)
        return torch.randint(3, hi, (n, length), generator=g).tolist()
    base = _text_ids(engine)
    if not base:
        raise TrtkvError("the packaged traces tokenized to nothing; use --prompt ids")
    reps = (length + 97 * n) // len(base) + 2
    ids = (base * reps)
    return [ids[97 * i: 97 * i + length] for i in range(n)]


_TEXT_CACHE: dict[int, list[int]] = {}


def _text_ids(engine) -> list[int]:
    key = id(engine.tokenizer)
    if key not in _TEXT_CACHE:
        from trtkv.eval.datasets import PACKAGE_DATA_DIR, load_traces

        text = "\n\n".join(t.prompt + t.completion for t in load_traces(PACKAGE_DATA_DIR / "traces_small.jsonl"))
        _TEXT_CACHE[key] = engine.tokenizer.encode(text)
    return _TEXT_CACHE[key]


# --- one measurement --------------------------------------------------------------------------------
_REQ_IDS = itertools.count(1 << 40)  # never collides with the engine's own request ids


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
    pool_bytes: int = 0
    rss_bytes: int | None = None


def run_once(be: BenchEngine, batch: int, cfg: BenchConfig, repeat: int, trace: bool = False,
             on_step=None) -> RunResult:
    from trtkv.runtime.request import Request
    from trtkv.runtime.sampling import SamplingParams, make_generator

    e = be.engine
    limit = e.arch.max_position_embeddings
    if cfg.prompt_len + cfg.gen_len > limit:
        raise TrtkvError(f"{be.label}: prompt_len + gen_len = {cfg.prompt_len + cfg.gen_len} exceeds the model's "
                         f"{limit} positions")
    params = SamplingParams(max_tokens=cfg.gen_len, ignore_eos=True, chat=False).validate(limit)
    prompts = make_prompts(e, batch, cfg.prompt_len, cfg.prompt_source, cfg.seed + repeat)
    reqs = [Request(next(_REQ_IDS), "", ids, params, make_generator(cfg.seed), limit) for ids in prompts]
    res = RunResult(be.label, batch, repeat)
    first = reqs[0]

    def timer(phase: str, rs, seconds: float) -> None:
        if phase == "prefill":
            res.prefill_s.append(seconds)
        else:
            res.decode_s.append(seconds)
            res.step_batch.append(len(rs))
            res.step_kv_total.append(sum(r.ctx.kv_bytes for r in rs))
            if on_step is not None:
                on_step()
        if trace and first in rs:
            res.trace.append((len(first.generated), first.ctx.kv_bytes))

    from trtkv.runtime.scheduler import Scheduler

    # a core and scheduler of its own (same weights, fresh cache): the engine's live core is never touched
    core = e.make_core()
    sched = Scheduler(core, max(batch, e.scheduler.max_batch), step_timer=timer)
    cuda = core.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(core.device)
        torch.cuda.reset_peak_memory_stats(core.device)
    t0 = time.perf_counter()
    for r in reqs:
        r.t_submit = t0
        sched.add(r)
    try:
        while not all(r.result for r in reqs):
            sched.step()
    finally:
        for r in list(sched.running):
            if r.req_id in core.cache.seqs:
                core.finish(r)
    res.e2e_s = time.perf_counter() - t0
    for r in reqs:
        s = r.result.stats
        res.ttft_s.append(s["time_to_first_token_s"] or 0.0)
        res.generated.append(s["generated_tokens"])
        res.kv_bytes_end.append(s["kv_bytes"])
        res.kv_bytes_peak.append(s["peak_kv_bytes"])
        res.kv_bytes_full.append(s["kv_bytes_full"])
        res.live_tokens.append(s["live_tokens"])
        res.evicted_tokens.append(s["evicted_tokens"])
        res.policy_stats.append(numeric_leaves({k: v for k, v in s.items() if k not in BASE_STATS | TIER_STATS}))
        res.tier_stats.append({k: float(s[k]) for k in TIER_STATS if k in s})
    res.pool_bytes = core.cache.pool_bytes()
    if cuda:
        res.peak_device_bytes = int(torch.cuda.max_memory_allocated(core.device))
    res.rss_bytes = _rss_bytes()
    return res


# what every request's stats hold; anything else comes from the policy (``KVPolicy.extra_stats``)
BASE_STATS = frozenset({"prompt_tokens", "generated_tokens", "kv_bytes", "kv_bytes_full", "peak_kv_bytes",
                        "tokens_per_s", "live_tokens", "peak_live_tokens", "pages", "evicted_tokens",
                        "time_to_first_token_s"})


# the cache's per-tier numbers (trtkv/cache/tiers.py::TierStore.stats), reported in their own columns
TIER_STATS = frozenset({"kv_bytes_device", "kv_bytes_staging", "kv_bytes_host", "peak_kv_bytes_device",
                        "peak_kv_bytes_host", "tokens_device", "tokens_host", "tokens_host_compressed",
                        "transfer_bytes", "kv_move_s"})


def numeric_leaves(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"thinkv": {"thought_shares": {"R": .6}}}`` -> ``{"thinkv.thought_shares.R": .6}`` (numbers only)."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(numeric_leaves(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def _mean_stats(per_request: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in per_request for k in d})
    return {k: statistics.fmean(d[k] for d in per_request if k in d) for k in keys}


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# --- the sweep --------------------------------------------------------------------------------------
def run_bench(engines: list[BenchEngine], cfg: BenchConfig, progress: bool | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run the sweep and return the results document (what ``results.json`` holds)."""
    from trtkv.bench.progress import progress_bar

    cfg.validate()
    load_start = [round(x, 2) for x in os.getloadavg()]
    if cfg.warmup:
        warm = BenchConfig(batch_sizes=(1,), prompt_len=min(16, cfg.prompt_len), gen_len=min(4, cfg.gen_len),
                           prompt_source=cfg.prompt_source, seed=cfg.seed)
        for be in engines:
            run_once(be, 1, warm, 0)
    runs: list[RunResult] = []
    total_steps = cfg.repeat * len(engines) * len(cfg.batch_sizes) * cfg.gen_len
    bar = progress_bar(total_steps, "bench", "step", progress)
    try:
        for rep in range(cfg.repeat):
            for b in cfg.batch_sizes:
                for be in engines:
                    bar.set_postfix_str(f"{be.label} batch={b} repeat={rep + 1}/{cfg.repeat}")
                    r = run_once(be, b, cfg, rep, trace=(rep == 0 and b == cfg.batch_sizes[0]),
                                 on_step=lambda: bar.update(1))
                    runs.append(r)
                    bar.update(cfg.gen_len - len(r.decode_s))  # steps the bar did not see (the prefill's token)
    finally:
        bar.close()
    doc = summarize(engines, cfg, runs, command)
    doc["machine"]["loadavg_1_5_15"] = load_start
    doc["machine"]["loadavg_1_5_15_end"] = [round(x, 2) for x in os.getloadavg()]
    busy = max(load_start[0], doc["machine"]["loadavg_1_5_15_end"][0])
    if busy > (os.cpu_count() or 1):
        doc["notes"].append(f"the machine was busy (1-minute load average up to {busy} on {os.cpu_count()} CPUs): "
                            "timings are noisy; use --repeat to take medians over interleaved repeats")
    return doc


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(engines: list[BenchEngine], cfg: BenchConfig, runs: list[RunResult],
              command: str | None = None) -> dict[str, Any]:
    rows = []
    for be in engines:
        wbytes = weight_bytes(be.engine.model)
        for b in cfg.batch_sizes:
            rs = [r for r in runs if r.engine == be.label and r.batch == b]
            steps = [s for r in rs for s in r.decode_s]
            e2e = statistics.median(r.e2e_s for r in rs)
            gen_tokens = statistics.median(sum(r.generated) for r in rs)
            # achieved bandwidth per step: weights once + every KV byte the running requests hold
            bw = [(wbytes + kv) / s for r in rs for s, kv in zip(r.decode_s, r.step_kv_total) if s > 0]
            peak_dev = [r.peak_device_bytes for r in rs if r.peak_device_bytes is not None]
            rows.append({
                "engine": be.label, "policy": be.engine.manifest.policy.name, "batch": b,
                "synthetic_weights": be.synthetic, "repeats": len(rs),
                "prefill_s_per_request": statistics.median(statistics.fmean(r.prefill_s) for r in rs),
                "prefill_s_batch": statistics.median(sum(r.prefill_s) for r in rs),
                "ttft_s_mean": statistics.median(statistics.fmean(r.ttft_s) for r in rs),
                "tpot_ms_p50": 1e3 * _pct(steps, 50) if steps else None,
                "tpot_ms_p90": 1e3 * _pct(steps, 90) if steps else None,
                "tpot_ms_p99": 1e3 * _pct(steps, 99) if steps else None,
                "e2e_s": e2e,
                "output_tokens": gen_tokens,
                "tokens_per_s": gen_tokens / e2e if e2e > 0 else None,
                "decode_tokens_per_s": b / _pct(steps, 50) if steps else None,
                "bandwidth_gb_s": (_pct(bw, 50) / 1e9) if bw else None,
                "max_concurrent": max((max(r.step_batch) for r in rs if r.step_batch), default=0),
                "kv_bytes_per_request_end": statistics.fmean(x for r in rs for x in r.kv_bytes_end),
                "kv_bytes_per_request_peak": max(x for r in rs for x in r.kv_bytes_peak),
                "kv_bytes_total_end": statistics.median(sum(r.kv_bytes_end) for r in rs),
                "kv_bytes_total_peak": max(max(r.step_kv_total, default=0) for r in rs),
                "kv_bytes_full_fp16_per_request": statistics.fmean(x for r in rs for x in r.kv_bytes_full),
                "live_tokens_end": statistics.fmean(x for r in rs for x in r.live_tokens),
                "evicted_tokens": statistics.fmean(x for r in rs for x in r.evicted_tokens),
                "peak_device_bytes": max(peak_dev) if peak_dev else None,
                "kv_pool_bytes": max(r.pool_bytes for r in rs),
                "rss_bytes": max((r.rss_bytes or 0) for r in rs) or None,
                "policy_stats": _mean_stats([d for r in rs for d in r.policy_stats]),  # mean over requests
                **_tier_summary(rs),
            })
    first = engines[0].label
    for row in rows:
        ref = next(r for r in rows if r["engine"] == first and r["batch"] == row["batch"])
        row["ratios_to_first"] = {k: _ratio(row[k], ref[k]) for k in
                                  ("tokens_per_s", "tpot_ms_p50", "e2e_s", "kv_bytes_per_request_peak")}
    fit = {}
    for be in engines:
        mine = [r for r in rows if r["engine"] == be.label]
        peak = max(r["kv_bytes_device_peak"] or r["kv_bytes_per_request_peak"] for r in mine)  # staging incl.
        full = int(max(r["kv_bytes_full_fp16_per_request"] for r in mine))
        fit[be.label] = {"per_request_peak_kv_bytes": peak, "kv_memory_bytes": cfg.kv_memory,
                         "max_batch": (cfg.kv_memory // peak) if cfg.kv_memory and peak else None,
                         "fit_full_fp16": (cfg.kv_memory // full) if cfg.kv_memory and full else None}
    from trtkv.cache.manager import fp16_bytes_per_token

    kv_trace = {}
    for be in engines:
        tr = next((r.trace for r in runs if r.engine == be.label and r.trace), [])
        a = be.engine.arch
        per_tok = fp16_bytes_per_token(a.num_hidden_layers, a.num_key_value_heads, a.head_dim)
        kv_trace[be.label] = {"generated_tokens": [g for g, _ in tr], "kv_bytes": [k for _, k in tr],
                              "kv_bytes_full_fp16": [(cfg.prompt_len + g) * per_tok for g, _ in tr]}
    synthetic = [be.label for be in engines if be.synthetic]
    notes = []
    if synthetic:
        notes.append(f"synthetic (random) weights: {', '.join(synthetic)} — timings and memory are those of the "
                     "architecture; attention patterns, and therefore what eviction policies keep, are not a real "
                     "model's")
    device = str(engines[0].engine.core.device)
    return {
        "kind": "trtkv-bench", "version": 1, "command": command, "machine": machine_info(device),
        "max_rss_bytes": _max_rss_bytes(), "config": asdict(cfg),
        "engines": [be.describe() for be in engines], "synthetic_weights": bool(synthetic),
        "results": rows, "max_batch_fit": fit, "fit_method": FIT_METHOD, "kv_trace": kv_trace,
        "runs": [_run_record(r) for r in runs], "notes": notes,
        "memory_note": ("peak_device_bytes: torch.cuda.max_memory_allocated during the run (weights included)"
                        if device.startswith("cuda") else
                        "CPU: kv_pool_bytes is the KV pools' allocated capacity (pools grow and are reused, not "
                        "returned); rss_bytes is the process's resident memory after the run"),
    }


def _tier_summary(rs: list[RunResult]) -> dict[str, Any]:
    """Tiered memory (trtkv/cache/tiers.py): device/host bytes, transfer bytes per decode step, and the share of
    step time spent moving KV between tiers (CPU: the copies' wall time; CUDA: copy-stream time, which may
    overlap compute — an upper bound on the stall)."""
    per = [d for r in rs for d in r.tier_stats]
    steps = sum(len(r.decode_s) for r in rs)
    step_s = sum(sum(r.decode_s) + sum(r.prefill_s) for r in rs)
    move_s = sum(d.get("kv_move_s", 0.0) for d in per)
    return {"kv_bytes_device_peak": max((d.get("peak_kv_bytes_device", 0) for d in per), default=0) or None,
            "kv_bytes_host_peak": max((d.get("peak_kv_bytes_host", 0) for d in per), default=0),
            "transfer_bytes_per_step": sum(d.get("transfer_bytes", 0) for d in per) / steps if steps else 0.0,
            "kv_move_share": move_s / step_s if step_s else 0.0}


def _ratio(a, b) -> float | None:
    return (a / b) if (a is not None and b) else None


def _run_record(r: RunResult) -> dict[str, Any]:
    d = asdict(r)
    d.pop("trace")
    return d


def write_results(doc: dict[str, Any], out: Path) -> list[Path]:
    """``results.json``, ``results.csv`` and the plots into ``out``; returns the written paths."""
    import csv

    from trtkv.bench import plots

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv"]
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    rows = doc["results"]
    stat_keys = sorted({k for r in rows for k in r["policy_stats"]})
    flat = [{**{k: v for k, v in r.items() if k not in ("ratios_to_first", "policy_stats")},
             **{f"ratio_{k}": v for k, v in r["ratios_to_first"].items()},
             **{f"policy.{k}": r["policy_stats"].get(k) for k in stat_keys}} for r in rows]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)
    written += plots.bench_plots(doc, out)
    return written
