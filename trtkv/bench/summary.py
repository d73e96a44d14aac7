"""The bench's results document: aggregated rows per engine x batch (latency, throughput, memory, tiers,
the decode-step profile), the largest batch that fits, the KV trace, and the files written from it."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtkv.bench.engines import BenchEngine, step_weight_bytes
from trtkv.bench.records import BenchConfig, RunResult

FIT_METHOD = (
    "largest batch that fits = floor(KV memory / per-request peak KV bytes), where the per-request peak is the "
    "largest `peak_kv_bytes` any request reached in this sweep (prompt_len + gen_len tokens): the cache's own "
    "accounting of pages (codes, scales, page metadata, block-table entries), key-scale groups and residual "
    "buffer at the request's worst moment (with host tiers: `peak_kv_bytes_device`, the device pages plus the "
    "two one-layer staging buffers; host bytes do not count against device memory). It assumes every request "
    "holds its peak at once (conservative for staggered requests) and ignores pool fragmentation and "
    "allocator overhead; `fit_full_fp16` is the same bound for an uncompressed fp16 cache of the same model.")

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

def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

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

def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(engines: list[BenchEngine], cfg: BenchConfig, runs: list[RunResult],
              command: str | None = None) -> dict[str, Any]:
    rows = []
    for be in engines:
        wbytes = step_weight_bytes(be.engine)
        for b in dict.fromkeys(r.batch for r in runs if r.engine == be.label):  # batch sizes, or requests queued
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
                "kv_pool_peak_bytes": max(r.pool_peak_bytes for r in rs),
                "rss_bytes": max((r.rss_bytes or 0) for r in rs) or None,
                "program_step_share": _program_share(rs),
                "policy_stats": _mean_stats([d for r in rs for d in r.policy_stats]),  # mean over requests
                **_tier_summary(rs),
                **_profile_summary(rs),
                **_memory_limited_summary(rs),
            })
    first = engines[0].label
    for row in rows:
        ref = next((r for r in rows if r["engine"] == first and r["batch"] == row["batch"]),
                   next(r for r in rows if r["engine"] == first))  # the memory-limited run: requests differ
        row["ratios_to_first"] = {k: _ratio(row[k], ref[k]) for k in
                                  ("tokens_per_s", "tpot_ms_p50", "e2e_s", "kv_bytes_per_request_peak",
                                   "engine_overhead_ms")}
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
        c = be.engine.core.cache.cfg  # (this rank's heads under tensor parallelism, as the bytes measured)
        per_tok = fp16_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim)
        kv_trace[be.label] = {"generated_tokens": [g for g, _ in tr], "kv_bytes": [k for _, k in tr],
                              "kv_bytes_full_fp16": [(cfg.prompt_len + g) * per_tok for g, _ in tr]}
    synthetic = [be.label for be in engines if be.synthetic]
    notes = []
    tp = max(be.engine.tp for be in engines)
    if tp > 1:
        notes.append(f"tensor parallel over {tp} ranks: weight and KV bytes are one rank's (rank 0's); KV heads "
                     "replicated on every rank when their count does not divide by the ranks")
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
                        "CPU: kv_pool_bytes is the KV pools' preallocated capacity (kv_memory or the 2 GiB default, "
                        "touched only as pages are used); kv_pool_peak_bytes the most pool pages and key-scale "
                        "groups in use at once; rss_bytes is the process's resident memory after the run"),
    }


def _memory_limited_summary(rs: list[RunResult]) -> dict[str, Any]:
    """The memory-limited run (``--requests``): the batch admission allows, the steady-state output tokens/s,
    and each request's peak KV as a share of an fp16 full cache (the seed paper's "Mem. ftprnt %")."""
    if not rs or rs[0].admission_batch is None:
        return {}
    # per request (one cut short by --duration holds fewer tokens than the rest)
    pct = [100.0 * p / f for r in rs for p, f in zip(r.kv_bytes_peak, r.kv_bytes_full) if f]
    cut = [r.cut_at_s for r in rs if r.cut_at_s is not None]
    return {"requests": rs[0].batch, "admission_batch": rs[0].admission_batch,
            "requests_finished": statistics.median(r.finished for r in rs),
            "cut_at_s": max(cut) if cut else None,
            "steady_tokens_per_s": statistics.median(steady_tokens_per_s(r) for r in rs),
            "kv_footprint_pct": statistics.median(pct) if pct else None}


STEADY_BATCH_SHARE = 0.9  # the steady state starts when the running batch first reaches this share of its maximum


def steady_tokens_per_s(r: RunResult) -> float:
    """Output tokens per second while the engine runs at its memory limit: decode steps from the first whose
    batch reaches ``STEADY_BATCH_SHARE`` of the run's largest, through the last that still had requests waiting
    (after it the batch only drains); the wall time between includes the newcomers' prefills. Falls back to the
    whole run when that window has fewer than two steps."""
    n = len(r.step_batch)
    top = max(r.step_batch, default=0)
    start = next((i for i, b in enumerate(r.step_batch) if b >= STEADY_BATCH_SHARE * top), n)
    end = max((i for i, w in enumerate(r.step_waiting) if w > 0), default=-1)
    if end - start < 1:
        total = sum(r.generated)
        return total / r.e2e_s if r.e2e_s > 0 else 0.0
    tokens = sum(r.step_batch[start + 1:end + 1])
    return tokens / (r.step_end_s[end] - r.step_end_s[start])


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


def _program_share(rs) -> float | None:
    """``--runtime graph``: the share of decode steps that ran in the compiled program (the rest ran eagerly)."""
    counts = [r.program_steps for r in rs if r.program_steps]
    total = sum(c["graph"] + c["eager"] for c in counts)
    return sum(c["graph"] for c in counts) / total if total else None


def _profile_summary(rs: list[RunResult]) -> dict[str, Any]:
    """``--profile``: mean milliseconds per decode step in each phase (they add up to ``step_ms_mean``) and
    the engine overhead: every phase but model compute and attention (kv_write + policy + bookkeeping)."""
    from trtkv.runtime.observers import PROFILE_PHASES

    steps = sum(len(r.decode_s) for r in rs)
    if not steps or not all(r.profile_s for r in rs):
        return {"profile_ms": None, "step_ms_mean": None, "engine_overhead_ms": None}
    ms = {p: 1e3 * sum(sum(r.profile_s[p]) for r in rs) / steps for p in PROFILE_PHASES}
    return {"profile_ms": ms, "step_ms_mean": 1e3 * sum(sum(r.decode_s) for r in rs) / steps,
            "engine_overhead_ms": ms["kv_write"] + ms["policy"] + ms["bookkeeping"]}


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
    flat = [{**{k: v for k, v in r.items() if k not in ("ratios_to_first", "policy_stats", "profile_ms")},
             **{f"profile_{k}_ms": v for k, v in (r["profile_ms"] or {}).items()},
             **{f"ratio_{k}": v for k, v in r["ratios_to_first"].items()},
             **{f"policy.{k}": r["policy_stats"].get(k) for k in stat_keys}} for r in rows]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)
    written += plots.bench_plots(doc, out)
    return written
