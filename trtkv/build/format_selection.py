"""ThinKV formats chosen by measurement at build time (``--set precision=auto``; beyond the paper).

The paper fixes R4E4T2 (NVFP4 for reasoning and execution, ternary for transitions). Which 4- or 2-bit
format keeps a given model's next-token distribution best is an empirical question (on SmolLM2 asymmetric
INT4 keeps far more than NVFP4, at more bytes), so the builder can answer it: for each thought type it
replays a few calibration traces teacher-forced through ThinKV's quantization alone (no eviction, so the
format is the only difference) with each candidate format for that type and fp16 for the others, and
scores top-1 agreement and KL against a full cache. Then it picks, over all combinations, the one with
the best expected agreement (the per-type scores weighted by the calibration's thought shares; ties: lower
KL, then fewer bits) whose average *stored* bits per element — scales and zero points included, weighted
by the same shares — fit ``avg_bits`` (default: what the paper's R4E4T2 costs under those shares).

The traces are the AReaL rollouts when available (not the traces ``trtkv eval`` scores), sampled with
``seed``; teacher forcing makes every replay deterministic, so a fixed seed gives a fixed choice.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trtkv.errors import TrtkvError
from trtkv.policies.thinkv import CODE_TO_FORMAT, E, NAME, R, T, format_precision, parse_precision

CANDIDATES = ("nvfp4", "nvfp4o", "int4", "ternary", "ternaryo", "int2", "fp8")
DEFAULT_PRECISION = "R4E4T2"  # the paper's; its cost under the shares is the default bits budget


def stored_bits(fmt: str, num_kv_heads: int, head_dim: int) -> float:
    """Bits stored per K/V element, per-group scales and zero points included (nvfp4 4.5, int4 6.0)."""
    from plugins.formats import get_format

    f = get_format(fmt)
    per_token = f.slot_bytes(num_kv_heads, head_dim) + f.group_bytes(num_kv_heads, head_dim) / max(1, f.group_size)
    return per_token * 8 / (2 * num_kv_heads * head_dim)


@dataclass
class FormatTrial:
    """One candidate format for one thought type, measured on the selection traces."""

    thought: str
    format: str
    bits: float
    top1_agreement: float
    mean_kl: float


@dataclass
class FormatSelection:
    """The choice and its evidence (written into engine.json as ``format_selection``)."""

    precision: str
    avg_bits: float  # of the choice, weighted by the shares
    avg_bits_budget: float
    expected_top1: float
    expected_kl: float
    shares: dict[str, float]
    candidates: list[str]
    trials: list[FormatTrial] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)
    tokens_per_trace: int = 0
    seed: int = 0
    method: str = ("per thought type: ThinKV quantization only (no eviction), candidate for that type and fp16 for "
                   "the others, teacher-forced against a full cache; best share-weighted top-1 (tie: KL, bits) "
                   "with share-weighted stored bits <= budget")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        out = [f"format selection ({len(self.traces)} trace(s) x {self.tokens_per_trace} forced tokens, seed "
               f"{self.seed}; shares {', '.join(f'{k}={v:.2f}' for k, v in self.shares.items())}):"]
        for t in self.trials:
            out.append(f"  {t.thought} {t.format:<9} {t.bits:5.2f} bits  top-1 {t.top1_agreement:.4f}  "
                       f"KL {t.mean_kl:.5f}")
        out.append(f"  chose precision={self.precision}: {self.avg_bits:.2f} bits (budget {self.avg_bits_budget:.2f}), "
                   f"expected top-1 {self.expected_top1:.4f}, KL {self.expected_kl:.5f}")
        return out


class _WithPolicy:
    """An engine seen through another policy (``make_core`` defaults to it); everything else delegates."""

    def __init__(self, engine, policy):
        self._engine, self.policy = engine, policy

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def make_core(self, policy=None, observers=(), **overrides):
        return self._engine.make_core(policy=policy or self.policy, observers=observers, **overrides)


@dataclass
class _Variant:  # what trtkv.eval.run.run_fidelity needs of a loaded engine
    label: str
    path: Path
    engine: Any


def shares_of(policy, calibration) -> dict[str, float]:
    """Thought shares the expected score and bits are weighted by: all R with one thought type, else the
    calibration's observed (or target) shares."""
    if policy.thought_types == 1 or not calibration:
        return {"R": 1.0}
    details = calibration if isinstance(calibration, dict) else calibration.details  # JSON or CalibrationArtifact
    raw = details.get("observed_shares") or details.get("target_shares") or {}
    got = {k: float(raw.get(k, 0.0)) for k in ("R", "E", "T")}
    total = sum(got.values())
    if total <= 0:
        return {"R": 1 / 3, "E": 1 / 3, "T": 1 / 3}
    return {k: v / total for k, v in got.items() if v > 0}


def _traces(tokenizer, n: int, max_tokens: int, seed: int, data: str | Path | None):
    from trtkv.eval import load_traces
    from trtkv.eval.datasets import DataFileNotFoundError

    try:
        pool = load_traces(data, None, task="traces_areal") if data is None else load_traces(data)
    except DataFileNotFoundError:
        pool = load_traces(None, None)
    long_enough = [t for t in pool if len(tokenizer.encode(t.completion)) >= max_tokens] or pool
    if not long_enough:
        raise TrtkvError("format selection found no calibration traces; pass a traces file")
    return random.Random(seed).sample(long_enough, min(n, len(long_enough)))


def select_formats(engine, policy, avg_bits: float | None = None, n_traces: int = 2, max_tokens: int = 128,
                   seed: int = 0, data: str | Path | None = None, candidates: tuple[str, ...] = CANDIDATES,
                   log: Callable[[str], None] = lambda m: None) -> FormatSelection:
    """Measure ``candidates`` per thought type on ``engine`` (a loaded ``Engine``) and choose ThinKV's
    precision; ``policy`` supplies the thought-type setup (its calibration is already loaded)."""
    from trtkv.eval.run import run_fidelity
    from trtkv.policies import make_policy

    arch = engine.arch
    calibration = engine.manifest.calibration
    shares = shares_of(policy, calibration)
    bits = {f: stored_bits(f, arch.num_key_value_heads, arch.head_dim) for f in candidates}
    default = parse_precision(DEFAULT_PRECISION)
    budget = avg_bits if avg_bits is not None else sum(
        s * stored_bits(default[{"R": R, "E": E, "T": T}[k]], arch.num_key_value_heads, arch.head_dim)
        for k, s in shares.items())
    traces = _traces(engine.tokenizer, n_traces, max_tokens, seed, data)
    drop = ("precision", "avg_bits", "budget", "tbe", "kv_format")
    base = {k: v for k, v in policy.params().items() if k not in drop}
    variants, keys = [], []
    for thought in shares:
        for fmt in candidates:
            if len(shares) == 1:
                prec = {c: fmt for c in (R, E, T)}
            else:
                prec = {c: "fp16" for c in (R, E, T)}
                prec[{"R": R, "E": E, "T": T}[thought]] = fmt
            pol = make_policy(policy.name, {**base, "precision": format_precision(prec), "tbe": False,
                                            "budget": None})
            pol.resolve_formats(engine.policy.kv_format)
            pol.load_calibration(calibration)
            variants.append(_Variant(f"{thought}:{fmt}", engine.path, _WithPolicy(engine, pol)))
            keys.append((thought, fmt))
    log(f"format selection: {len(variants)} candidate(s) x {len(traces)} trace(s) x {max_tokens} tokens ...")
    recs = run_fidelity(variants, traces, max_tokens=max_tokens, recall_layers="none", batch=len(traces),
                        progress=False)
    by = {r["engine"]: r for r in recs if not r["is_reference"]}
    trials = [FormatTrial(t, f, round(bits[f], 4), by[f"{t}:{f}"]["top1_agreement"], by[f"{t}:{f}"]["mean_kl"])
              for t, f in keys]
    score = {(t.thought, t.format): t for t in trials}
    best = None
    for combo in itertools.product(candidates, repeat=len(shares)):
        pick = dict(zip(shares, combo))
        b = sum(shares[k] * bits[f] for k, f in pick.items())
        if b > budget + 1e-9:
            continue
        top1 = sum(shares[k] * score[(k, f)].top1_agreement for k, f in pick.items())
        kl = sum(shares[k] * score[(k, f)].mean_kl for k, f in pick.items())
        key = (-round(top1, 12), round(kl, 12), b)
        if best is None or key < best[0]:
            best = (key, pick, b, top1, kl)
    if best is None:
        cheapest = min(bits.values())
        raise TrtkvError(f"avg_bits={budget:g} is below every candidate format (the cheapest stores {cheapest:.2f} "
                         "bits per element); raise avg_bits")
    _, pick, b, top1, kl = best
    fmts = {c: pick.get(NAME[c], pick.get("R")) for c in (R, E, T)}
    return FormatSelection(precision=format_precision(fmts), avg_bits=round(b, 4), avg_bits_budget=round(budget, 4),
                           expected_top1=top1, expected_kl=kl, shares=shares, candidates=list(candidates),
                           trials=trials, traces=[t.id for t in traces], tokens_per_trace=max_tokens, seed=seed)


__all__ = ["CANDIDATES", "CODE_TO_FORMAT", "FormatSelection", "FormatTrial", "select_formats", "stored_bits",
           "shares_of"]
