"""Collection: FullKV generations on the calibration prompts while an observer records ThinKV's statistic.

Why an observer: calibration must see exactly what a full-cache engine computes, so it watches a core
built for it (``Engine.make_core(observers=...)``) instead of swapping the engine's policy. The statistic
is the one ThinKV's decode path thresholds (``runtime/attention.py::row_stats``: max-pool the G query
heads of a KV group, softmax, average the groups' rows, count entries below 1% of the row max), recorded
for every layer on every ``stride``-th decode step.

``min_keys`` (default 64): a row over ``n`` keys has a sparsity quantised in steps of ``1/n`` and, while
``n`` is small, reflects the prompt more than what is being generated; 64 keys keep the step under 1.6%.
ThinKV reads the statistic only every τ = 128 tokens of far longer generations, so the skipped first
steps do not matter there either.

At the end of each request the observer also reads its K and V of every layer (paged and buffered) and
keeps the per-layer max |K| and |V| over all prompts (``kv_amax``): the static second-level scales of
NVFP4 / ternary / FP8 (spec §3.2).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trtkv.errors import TrtkvError
from trtkv.policies.base import StatsRequest, StepStats
from trtkv.runtime.observers import EngineObserver

DEFAULT_MIN_KEYS = 64
UNQUANTIZED = ("fp32", "fp16", "bf16")

Log = Callable[[str], None]


@dataclass
class CalibrationData:
    """What the collection recorded: per prompt, ``u[p]`` of shape ``[steps, layers]``."""

    u: list[np.ndarray]
    steps: list[np.ndarray]
    k_amax: np.ndarray
    v_amax: np.ndarray
    prompt_ids: list[str]
    generated_tokens: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(len(self.k_amax))


class SparsityObserver(EngineObserver):
    """Records ``u[step, layer]`` of sampled decode steps and each request's K/V amax at finish."""

    def __init__(self, num_layers: int, stride: int = 1, min_keys: int = DEFAULT_MIN_KEYS):
        self.num_layers, self.stride, self.min_keys = num_layers, stride, min_keys
        self._rows: dict[int, list[np.ndarray]] = {}
        self._steps: dict[int, list[int]] = {}
        self.records: dict[int, dict[str, np.ndarray]] = {}  # req_id -> u, steps, k_amax, v_amax

    def stats_request(self, phase: str) -> StatsRequest | None:
        return StatsRequest(sparsity=True) if phase == "decode" else None

    def on_decode(self, reqs, logits, stats: list[StepStats]) -> None:
        for req, st in zip(reqs, stats):
            if st.step < 0 or st.step % self.stride or not st.layers:
                continue
            if max(len(ls.positions) for ls in st.layers.values()) < self.min_keys:
                continue
            row = np.full(self.num_layers, np.nan)
            for layer, ls in st.layers.items():
                if ls.sparsity is not None:
                    row[layer] = ls.sparsity
            self._rows.setdefault(req.req_id, []).append(row)
            self._steps.setdefault(req.req_id, []).append(st.step)

    def on_finish(self, req, result) -> None:
        L = self.num_layers
        k_amax, v_amax = np.zeros(L), np.zeros(L)
        for layer in range(L):
            pos = req.ctx.all_positions(layer)
            if len(pos):
                k, v = req.ctx.kv(layer, pos)
                k_amax[layer], v_amax[layer] = float(k.abs().max()), float(v.abs().max())
        u = np.array(self._rows.pop(req.req_id, []), dtype=np.float64).reshape(-1, L)
        steps = np.array(self._steps.pop(req.req_id, []), dtype=np.int64)
        self.records[req.req_id] = {"u": u, "steps": steps, "k_amax": k_amax, "v_amax": v_amax}


def model_default_sampling(engine) -> dict[str, Any]:
    """Sampling from the checkpoint's ``generation_config.json`` (kept in the engine's tokenizer/ dir)."""
    path = Path(engine.path) / "tokenizer" / "generation_config.json"
    try:
        gc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"temperature": 0.0}
    if not gc.get("do_sample") or not gc.get("temperature"):
        return {"temperature": 0.0}
    out = {"temperature": float(gc["temperature"])}
    if gc.get("top_p") is not None:
        out["top_p"] = float(gc["top_p"])
    if gc.get("top_k"):
        out["top_k"] = int(gc["top_k"])
    return out


def _generate(engine, sched, prompts: list[str], params: list) -> list:
    """Requests through ``sched`` (a core of the engine, not its own) in one continuous batch."""
    reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    return reqs


def collect_sparsity(engine, prompts: Sequence[str], max_tokens: int = 1024, stride: int = 1,
                     min_keys: int = DEFAULT_MIN_KEYS, batch_size: int = 8, temperature: float | None = None,
                     seed: int = 0, prompt_ids: Sequence[str] | None = None, log: Log | None = None
                     ) -> CalibrationData:
    """Run FullKV generations of ``prompts`` on a core of ``engine`` and record ThinKV's sparsity.

    ``engine`` must hold every token at full precision (a ``full`` engine; ``open_full_engine`` makes one);
    it is not modified."""
    from trtkv.runtime.sampling import SamplingParams
    from trtkv.runtime.scheduler import Scheduler

    if stride < 1 or min_keys < 1 or max_tokens < 1 or batch_size < 1:
        raise TrtkvError("calibration: stride, min_keys, max_tokens and batch_size must be positive")
    if not prompts:
        raise TrtkvError("calibration: no prompts")
    fmt = engine.policy.kv_format
    if engine.policy.name != "full" or fmt not in UNQUANTIZED:
        raise TrtkvError("calibration needs a full-cache engine with an unquantized format (got policy "
                         f"{engine.policy.name!r}, format {fmt!r}); use open_full_engine()")
    sampling = model_default_sampling(engine) if temperature is None else {"temperature": float(temperature)}
    L = engine.arch.num_hidden_layers
    us, steps, gen = [], [], []
    k_amax, v_amax = np.zeros(L), np.zeros(L)
    obs = SparsityObserver(L, stride, min_keys)
    sched = Scheduler(engine.make_core(observers=(obs,)), batch_size)
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        chunk = list(prompts[b:b + batch_size])
        params = [SamplingParams(max_tokens=max_tokens, seed=seed + b + i, chat=True, **sampling)
                  for i in range(len(chunk))]
        for req in _generate(engine, sched, chunk, params):
            r = obs.records.pop(req.req_id, None)
            if r is None or req.result is None:
                raise TrtkvError(f"calibration: request {req.req_id} finished without a record")
            us.append(r["u"])
            steps.append(r["steps"])
            gen.append(len(req.result.token_ids))
            k_amax = np.maximum(k_amax, r["k_amax"])
            v_amax = np.maximum(v_amax, r["v_amax"])
        if log:
            log(f"[calibrate] {b + len(chunk)}/{len(prompts)} prompts, {sum(len(x) for x in us)} steps recorded, "
                f"{time.perf_counter() - t0:.1f} s")
    ids = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(prompts))]
    meta = {"max_tokens": max_tokens, "step_stride": stride, "min_keys": min_keys, "sampling": sampling,
            "seed": seed, "collect_s": round(time.perf_counter() - t0, 2)}
    return CalibrationData(us, steps, k_amax, v_amax, ids, gen, meta)
