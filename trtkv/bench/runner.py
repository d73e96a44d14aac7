"""The bench sweep: for every engine and batch size, B requests of ``prompt_len`` tokens each generate
exactly ``gen_len`` tokens (``ignore_eos``) through the engine's own scheduler, which times every
prefill and every batched decode step (``Scheduler.step_timer``, device-synchronised).

Engines are measured in the same process and interleaved per repeat (repeat 0: every batch size of every
engine, then repeat 1, ...), so slow drifts of a shared machine hit all engines alike and the ratios to
the first engine are meaningful.

The memory-limited run (``--requests N|auto --kv-memory SIZE``, the seed paper's Table 2): each engine's KV
pools get ``SIZE``; its requests are queued at once and the scheduler admits as many as the pools hold at their
worst case (``trtkv/bench/capacity.py``), admitting the next as one finishes (continuous batching).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Any

import torch

from trtkv.bench.capacity import Capacity, largest_batch
from trtkv.bench.engines import BenchEngine, load_engines, weight_bytes  # noqa: F401  (re-exported)
from trtkv.bench.records import BenchConfig, RunResult
from trtkv.bench.summary import BASE_STATS, TIER_STATS, machine_info, numeric_leaves, summarize, write_results  # noqa: F401
from trtkv.errors import TrtkvError
from trtkv.runtime.observers import StepProfiler
from trtkv.sizes import parse_size  # noqa: F401  (re-exported by trtkv.bench)


# --- parsing ----------------------------------------------------------------------------------------
def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(p) for p in str(text).replace(";", ",").split(",") if p.strip())
    except ValueError:
        raise TrtkvError(f"--batch-sizes {text!r}: expected comma-separated integers like 1,8,32") from None
    if not sizes or any(b <= 0 for b in sizes):
        raise TrtkvError(f"--batch-sizes {text!r}: expected positive integers like 1,8,32")
    return tuple(dict.fromkeys(sizes))

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


def run_once(be: BenchEngine, batch: int, cfg: BenchConfig, repeat: int, trace: bool = False,
             on_step=None, capacity: Capacity | None = None) -> RunResult:
    """``batch`` requests at once; with ``capacity`` (the memory-limited run, ``bench/capacity.py``) they are
    queued, the KV pools are ``cfg.kv_memory`` with the arenas ``capacity`` sized, and at most
    ``capacity.batch`` run at a time."""
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
    admission_batch = capacity.batch if capacity is not None else None
    res = RunResult(be.label, batch, repeat, admission_batch=admission_batch)
    first = reqs[0]
    profiler = StepProfiler(e.core.device) if cfg.profile else None

    def timer(phase: str, rs, seconds: float) -> None:
        if phase == "prefill":  # a packed group's pass: each request its share
            res.prefill_s.extend([seconds / len(rs)] * len(rs))
        else:
            res.decode_s.append(seconds)
            res.step_batch.append(len(rs))
            res.step_kv_total.append(sum(r.ctx.kv_bytes for r in rs))
            res.step_end_s.append(time.perf_counter() - t0)
            res.step_waiting.append(len(sched.waiting))
            if profiler is not None:
                for part, s in profiler.step_parts(seconds).items():
                    res.profile_s.setdefault(part, []).append(s)
            if on_step is not None:
                on_step()
        if trace and first in rs:
            res.trace.append((len(first.generated), first.ctx.kv_bytes))

    from trtkv.runtime.scheduler import Scheduler

    # a core and scheduler of its own (same weights, fresh cache): the engine's live core is never touched
    # (the sweep: residual buffers for the whole batch, set aside before the pools take the device's memory)
    limits = ({"max_batch": max(batch, e.cache_cfg.max_batch)} if capacity is None else
              {"kv_memory": cfg.kv_memory, "max_batch": capacity.batch,
               "key_groups_per_page": capacity.key_groups_per_page})
    core = e.make_core(observers=(profiler,) if profiler is not None else (), **limits)
    sched = Scheduler(core, admission_batch or max(batch, e.scheduler.max_batch), step_timer=timer,
                      prefill_tokens=cfg.prefill_tokens)
    cuda = core.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(core.device)
        torch.cuda.reset_peak_memory_stats(core.device)
    t0 = time.perf_counter()
    for r in reqs:
        r.t_submit = t0
        sched.add(r)
    deadline = t0 + cfg.duration_s if capacity is not None and cfg.duration_s else None
    try:
        while not all(r.result for r in reqs):
            sched.step()
            if deadline is not None and time.perf_counter() > deadline and not all(r.result for r in reqs):
                res.cut_at_s = time.perf_counter() - t0
                break
    finally:
        for r in list(sched.running):
            if r.req_id in core.cache.seqs:
                core.finish(r)
    res.e2e_s = time.perf_counter() - t0
    res.finished = sum(1 for r in reqs if r.result and r.result.finish_reason == "length")
    for r in (r for r in reqs if r.result):  # (a run cut by --duration leaves the waiting ones without one)
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
    res.pool_peak_bytes = core.cache.pool_peak_bytes()
    if cuda:
        res.peak_device_bytes = int(torch.cuda.max_memory_allocated(core.device))
    res.rss_bytes = _rss_bytes()
    if core.device_step is not None:
        res.program_steps = dict(core.device_step.counts)
    return res

def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None

# --- the sweep --------------------------------------------------------------------------------------
def _plan(engines: list[BenchEngine], cfg: BenchConfig
          ) -> list[tuple[BenchEngine, tuple[int, ...], Capacity | None]]:
    """Per engine: the request counts to run and, in the memory-limited run, what admission allows in
    ``cfg.kv_memory`` (None in the batch sweep, where every request runs at once)."""
    if not cfg.memory_limited:
        return [(be, cfg.batch_sizes, None) for be in engines]
    import dataclasses

    out = []
    for be in engines:
        e = be.engine
        cache_cfg = dataclasses.replace(e.core.cache.cfg, kv_memory=cfg.kv_memory)
        cap = largest_batch(e.policy, cache_cfg, cfg.prompt_len, cfg.gen_len)
        n = cfg.requests if cfg.requests is not None else max(1, round(cfg.requests_auto * cap.batch))
        out.append((be, (n,), cap))
    return out


def run_bench(engines: list[BenchEngine], cfg: BenchConfig, progress: bool | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run the sweep and return the results document (what ``results.json`` holds)."""
    from trtkv.progress import progress_bar

    cfg.validate()
    load_start = [round(x, 2) for x in os.getloadavg()]
    if cfg.warmup:
        warm = BenchConfig(batch_sizes=(1,), prompt_len=min(16, cfg.prompt_len), gen_len=min(4, cfg.gen_len),
                           prompt_source=cfg.prompt_source, seed=cfg.seed)
        for be in engines:
            # the graph runtime compiles a program for batch 1 and one for batches of 2 and more: warm the ones the
            # runs use (a compile is ~35 s an 8B program on a GPU); eager warms at batch 1
            graph = be.engine.runtime == "graph"
            if not graph or 1 in cfg.batch_sizes or cfg.memory_limited:
                run_once(be, 1, warm, 0)
            if graph and (max(cfg.batch_sizes) > 1 or cfg.memory_limited):
                run_once(be, 2, dataclasses.replace(warm, batch_sizes=(2,)), 0)
    runs: list[RunResult] = []
    plan = _plan(engines, cfg)
    total_steps = cfg.repeat * cfg.gen_len * sum(-(-b // cap.batch) if cap else 1
                                                 for _, sizes, cap in plan for b in sizes)
    bar = progress_bar(total_steps, "bench", "step", progress)
    try:
        for rep in range(cfg.repeat):
            for i in range(max(len(sizes) for _, sizes, _ in plan)):
                for be, sizes, cap in plan:
                    b = sizes[i]
                    what = f"requests={b} (at most {cap.batch} at once)" if cap else f"batch={b}"
                    bar.set_postfix_str(f"{be.label} {what} repeat={rep + 1}/{cfg.repeat}")
                    r = run_once(be, b, cfg, rep, trace=(rep == 0 and i == 0), on_step=lambda: bar.update(1),
                                 capacity=cap)
                    runs.append(r)
                    if not cap:
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
