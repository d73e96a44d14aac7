"""ThinKV's offline calibration (spec §2.3, Algorithm 1 of the paper): which layers' attention sparsity
separates the thought types, and the two sparsity thresholds between them.

Pipeline::

    collect_sparsity(engine, prompts)  ->  CalibrationData   (FullKV generations through trtkv's own engine)
    analyze(data.u)                    ->  Analysis          (KDE per (prompt, layer), modes, layers, thresholds)
    make_artifact(...)                 ->  dict (JSON)        load_calibration() validates one
    calibrate(model, ...)              ->  dict              the whole thing (``trtkv calibrate``)
    calibrate_for_build(model, ...)    ->  dict              what ``trtkv build --policy thinkv`` calls

**Collection.** One FullKV generation per calibration prompt (chat template on; greedy unless the model
ships a sampling default in ``generation_config.json`` or ``temperature`` is given), batched through
``Engine.generate``. A private recording policy (a :class:`FullPolicy` subclass, deliberately *not* in
the public registry) asks the attention for ThinKV's sparsity statistic on every ``stride``-th decode step
whose row has at least ``min_keys`` keys and stores ``u[p][t, l]`` for every layer. The statistic is the
one the decode path thresholds (``runtime/attention.py::row_stats``: max-pool the G query heads of a KV
group, softmax, average the groups' rows, count entries below 1% of the row max), tagged
``thinkv-avgrow-v1`` (spec §8 A4) so a policy can refuse thresholds computed under another definition.

``min_keys`` (default 64): a row over ``n`` keys has a sparsity quantised in steps of ``1/n`` and, while
``n`` is small, is dominated by the prompt rather than by what is being generated; 64 keys keep the
quantisation step under 1.6%. At decode time ThinKV reads the statistic only at refresh steps
(every τ = 128 tokens) of generations that are usually far longer, so the excluded first steps do not
matter there either.

At the end of each request the recorder also reads the request's post-RoPE K and V of every layer back
from the cache and keeps the per-layer max |K| and max |V| over all prompts (``kv_amax``): the engine
turns them into the static second-level scales of NVFP4 / ternary / FP8 (spec §3.2,
``plugins.formats.quantized.calibrate_layer_scales``; see :func:`layer_scales`).

**Analysis (rule ``kde-valleys``).** Per (prompt, layer): a Gaussian KDE with Scott's bandwidth
(``scipy.stats.gaussian_kde``; for more than 4,096 points the same kernel and bandwidth evaluated by
linear binning + convolution, which is exact to ~1e-6 relative and keeps 100 × 32K-token runs cheap)
on a 1001-point grid over [0, 1]. Modes are the grid's local maxima with a height of at least 5% of the
KDE's global maximum (an edge point of [0, 1] counts when it is higher than its neighbour). ``L*[p]`` are
the layers with exactly 3 modes; layers are ranked by the number of prompts on which they have exactly
3 modes, ties broken by the mean normalised valley depth ``(min(peak_left, peak_right) - valley) / max``,
then by within-prompt variability; the top ``num_layers`` (ℓ*) whose 3-mode support reaches
``min_support`` (default: half of the prompts) are ``L*``. This equals ``∩_p L*[p]`` when that
intersection has exactly ℓ* layers (spec §2.3 step 4). If fewer than ℓ* layers have that support, only
those are taken (the paper: "select layers exhibiting |T| sparsity modes (can be less than |L*|)"), with
a warning. The thresholds are the KDE minima between consecutive modes, averaged over the (layer ∈ L*,
prompt) pairs that have exactly 3 modes.

**Fallback (rule ``fallback-quantiles``).** When no layer has 3 modes on at least ``min_support`` of the
prompts — measured on SmolLM2-135M, which is not a reasoning model, see
``shared/specs/thinkv-small-models.md`` — the KDE has no valleys to read thresholds from. Then:

* ``L*`` = the ℓ* layers with the largest *mean within-prompt standard deviation* of the per-step
  sparsity. Why this statistic: a thought label is a per-request, per-step decision, so only variation
  of ``u`` *during* one generation can separate thought types; differences between prompts (a longer
  prompt is sparser throughout) only shift every step of a prompt into one class, and a pooled spread or
  a pooled-KDE entropy would reward exactly those. (KDE entropy with Scott's bandwidth is, for a unimodal
  layer, essentially ``log sd`` of the pooled data, i.e. the same ranking with the between-prompt part
  mixed in.) On a layer whose ``u`` barely moves within a generation, thresholds would only cut noise.
  Measured on SmolLM2-135M (4 prompts × 192 tokens): a trend in log-position explains under 15% of the
  within-prompt variance of the layers this rule picks (under 32% in any layer), so the statistic is
  not a proxy for position at these lengths. ``per_layer[].lag1_autocorr`` reports how persistent the
  variation is from one recorded step to the next (thought segments span 100–300 tokens, so a layer
  whose variation is per-token noise gives labels that are noisy too).
* ``ū`` per recorded step = the mean of ``u`` over those layers (what decode computes), pooled over all
  prompts and steps; ``θ_low`` = the ``share_E`` quantile and ``θ_high`` = the ``1 - share_T`` quantile,
  so that ``E: ū < θ_low``, ``R: θ_low ≤ ū < θ_high``, ``T: ū ≥ θ_high`` (spec §2.1) reproduce the
  target shares on the calibration data.
* Target shares default to E 0.2 / R 0.6 / T 0.2. The paper's Figure 10(f) shows the R/T/E breakdown for
  R1-Llama-8B only as a chart (R dominant; more T on AIME than on MATH-500); its text gives the average
  precisions 3.4 bits (§5, R1-Llama-8B at k=1024), 3.5 (TBQ alone, Table 4) and 3.6–3.9 (appendix),
  which under R4E4T2 (``4·(1-f_T) + 2·f_T``) mean a T share of 0.05–0.30; 0.2 sits in that range.
  Override with ``target_shares``.

The artifact then says ``rule: "fallback-quantiles"`` and carries a ``warning`` that ``trtkv calibrate``
and ``trtkv build`` print loudly: the labels are sparsity quantiles, not evidence of thought types.

**How many thought types ThinKV uses** (``thought_types`` in the artifact). With valleys (``kde-valleys``)
it is 3. Without them the default is 1: the paper's own setting for LLMs that show no thought structure
(its §E.10: "we set |T| = 1 with B = 4, treating all tokens as a single category"; eviction then happens
only at the budget). Three quantile bands on such a model put T's 2-bit ternary on whatever tokens fall
in the top sparsity band; on SmolLM2 that was 37-50% of a 1,024-token generation and the text fell
apart within ~300 tokens (docs/benchmarks.md), so the bands are kept in the artifact but used only on
request (``trtkv calibrate --fallback-types 3``, or ``--set thought_types=3`` on the engine).
"""
from __future__ import annotations

import datetime as dt
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trtkv.errors import TrtkvError
from trtkv.policies.base import StatsRequest, StepStats
from trtkv.policies.full import FullPolicy

ARTIFACT_VERSION = 1
SPARSITY_DEF_VERSION = "thinkv-avgrow-v1"
REL_THRESHOLD = 0.01
RULE_KDE = "kde-valleys"
RULE_FALLBACK = "fallback-quantiles"
RULES = (RULE_KDE, RULE_FALLBACK)
THOUGHT_TYPE_COUNTS = (1, 3)  # 1: the paper's §E.10 single category (no labels); 3: R / E / T
TYPES = ("E", "R", "T")  # ascending sparsity
DEFAULT_TARGET_SHARES = {"E": 0.2, "R": 0.6, "T": 0.2}
DEFAULT_NUM_LAYERS = 4
DEFAULT_MIN_KEYS = 64
GRID_POINTS = 1001
MODE_FLOOR = 0.05
MIN_POINTS = 8  # a (prompt, layer) with fewer recorded steps is left out of the analysis
EXACT_KDE_MAX_POINTS = 4096
KDE_STORE_POINTS = 241  # densities kept in the artifact (for the plot), over the data's window
N_THOUGHT_TYPES = 3

Log = Callable[[str], None]


# --- collection -----------------------------------------------------------------------------------
@dataclass
class _RecorderState:
    u: list = field(default_factory=list)
    steps: list = field(default_factory=list)


@dataclass
class _SparsityRecorder(FullPolicy):
    """FullKV plus a tap: ThinKV's sparsity of every layer on sampled decode steps, and K/V amax.

    Private to calibration (not registered): building an engine with it makes no sense."""

    name = "calibration-recorder"
    State = _RecorderState
    description = "FullKV that records ThinKV's per-layer sparsity (calibration only)"
    stride: int = 1
    min_keys: int = DEFAULT_MIN_KEYS

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        self.records: dict[int, dict[str, Any]] = {}

    def _wanted(self, req) -> bool:
        return req.step >= 0 and req.step % self.stride == 0 and req.position + 1 >= self.min_keys

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase == "decode" and self._wanted(req):
            return StatsRequest(sparsity=True)
        return None

    def on_decode_step_end(self, req, stats: StepStats) -> None:
        if not stats.layers:
            return
        n_keys = max(len(ls.positions) for ls in stats.layers.values())
        if n_keys < self.min_keys:
            return
        row = np.full(req.num_layers, np.nan)
        for layer, ls in stats.layers.items():
            if ls.sparsity is not None:
                row[layer] = ls.sparsity
        req.state.u.append(row)
        req.state.steps.append(stats.step)

    def on_request_finish(self, req) -> None:
        L = req.num_layers
        k_amax, v_amax = np.zeros(L), np.zeros(L)
        for layer in range(L):
            pos = req.all_positions(layer)
            if len(pos):
                k, v = req.kv(layer, pos)
                k_amax[layer] = float(k.abs().max())
                v_amax[layer] = float(v.abs().max())
        u = np.array(req.state.u, dtype=np.float64).reshape(-1, L)
        self.records[req.req_id] = {"u": u, "steps": np.array(req.state.steps, dtype=np.int64),
                                    "k_amax": k_amax, "v_amax": v_amax}


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


def collect_sparsity(engine, prompts: Sequence[str], max_tokens: int = 1024, stride: int = 1,
                     min_keys: int = DEFAULT_MIN_KEYS, batch_size: int = 8, temperature: float | None = None,
                     seed: int = 0, prompt_ids: Sequence[str] | None = None, log: Log | None = None
                     ) -> CalibrationData:
    """Run FullKV generations of ``prompts`` on ``engine`` and record ThinKV's sparsity.

    ``engine`` must hold every token (a ``full`` engine; :func:`open_full_engine` makes one); its policy
    is swapped for the recorder for the duration of the call."""
    from trtkv.runtime.sampling import SamplingParams

    if stride < 1 or min_keys < 1 or max_tokens < 1 or batch_size < 1:
        raise TrtkvError("calibration: stride, min_keys, max_tokens and batch_size must be positive")
    if not prompts:
        raise TrtkvError("calibration: no prompts")
    sampling = model_default_sampling(engine) if temperature is None else {"temperature": float(temperature)}
    rec = _SparsityRecorder(stride=stride, min_keys=min_keys)
    rec.kv_format = engine.policy.kv_format
    if engine.policy.name != "full" or rec.kv_format not in ("fp32", "fp16", "bf16"):
        raise TrtkvError("calibration needs a full-cache engine with an unquantized format (got policy "
                         f"{engine.policy.name!r}, format {rec.kv_format!r}); use open_full_engine()")
    old = engine.policy, engine.core.policy
    engine.policy = engine.core.policy = rec
    L = engine.arch.num_hidden_layers
    us, steps, gen = [], [], []
    k_amax, v_amax = np.zeros(L), np.zeros(L)
    t0 = time.perf_counter()
    try:
        for b in range(0, len(prompts), batch_size):
            chunk = list(prompts[b:b + batch_size])
            params = [SamplingParams(max_tokens=max_tokens, seed=seed + b + i, chat=True, **sampling)
                      for i in range(len(chunk))]
            rec.records.clear()
            results = engine.generate(chunk, params)
            recs = [rec.records[k] for k in sorted(rec.records)]
            if len(recs) != len(chunk):
                raise TrtkvError(f"calibration: recorded {len(recs)} of {len(chunk)} requests")
            for r, res in zip(recs, results):
                us.append(r["u"])
                steps.append(r["steps"])
                gen.append(len(res.token_ids))
                k_amax = np.maximum(k_amax, r["k_amax"])
                v_amax = np.maximum(v_amax, r["v_amax"])
            if log:
                done = b + len(chunk)
                log(f"[calibrate] {done}/{len(prompts)} prompts, {sum(len(x) for x in us)} steps recorded, "
                    f"{time.perf_counter() - t0:.1f} s")
    finally:
        engine.policy, engine.core.policy = old
    ids = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(prompts))]
    meta = {"max_tokens": max_tokens, "step_stride": stride, "min_keys": min_keys, "sampling": sampling,
            "seed": seed, "collect_s": round(time.perf_counter() - t0, 2)}
    return CalibrationData(us, steps, k_amax, v_amax, ids, gen, meta)


# --- KDE, modes, valleys --------------------------------------------------------------------------
def kde_on_grid(x: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, float]:
    """Gaussian KDE with Scott's bandwidth evaluated on ``grid``; returns (density, bandwidth).

    Degenerate samples (fewer than 2 finite points, or no spread) give a narrow bump of width one grid
    step at their mean (one mode) and bandwidth 0; an empty sample gives zeros."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    step = float(grid[1] - grid[0]) if len(grid) > 1 else 1e-3
    if len(x) == 0:
        return np.zeros_like(grid), 0.0
    spread = float(x.max() - x.min())
    bump = np.exp(-0.5 * ((grid - x.mean()) / step) ** 2) / (step * math.sqrt(2 * math.pi))
    if len(x) < 2 or spread < 1e-9:
        return bump, 0.0
    from scipy.stats import gaussian_kde

    try:
        kde = gaussian_kde(x)
        bw = float(math.sqrt(kde.covariance[0, 0]))
    except (np.linalg.LinAlgError, ValueError):
        return bump, 0.0
    if not math.isfinite(bw) or bw <= 0:
        return bump, 0.0
    if len(x) <= EXACT_KDE_MAX_POINTS:
        return kde(grid), bw
    return _binned_kde(x, bw, grid), bw


def _binned_kde(x: np.ndarray, bw: float, grid: np.ndarray) -> np.ndarray:
    """The same Gaussian KDE by linear binning on a grid 20x finer than the bandwidth, then convolution."""
    from scipy.signal import fftconvolve

    delta = min(bw / 20.0, float(grid[1] - grid[0]) / 4)
    lo = min(float(grid[0]), float(x.min())) - 6 * bw
    hi = max(float(grid[-1]), float(x.max())) + 6 * bw
    nb = int(math.ceil((hi - lo) / delta)) + 2
    pos = (x - lo) / delta
    i0 = np.floor(pos).astype(np.int64)
    w1 = pos - i0
    counts = np.bincount(i0, weights=1 - w1, minlength=nb) + np.bincount(i0 + 1, weights=w1, minlength=nb)
    half = int(math.ceil(6 * bw / delta))
    t = np.arange(-half, half + 1) * delta
    kern = np.exp(-0.5 * (t / bw) ** 2) / (bw * math.sqrt(2 * math.pi) * len(x))
    dens = fftconvolve(counts[:nb], kern, mode="same")
    return np.interp(grid, lo + np.arange(nb) * delta, np.maximum(dens, 0.0))


def find_modes(f: np.ndarray, floor: float = MODE_FLOOR) -> np.ndarray:
    """Indices of local maxima of ``f`` at least ``floor`` × its global maximum (edges count when they
    exceed their one neighbour; a flat top counts once, at its left end)."""
    f = np.asarray(f, dtype=np.float64)
    if len(f) == 0 or not np.isfinite(f).all() or f.max() <= 0:
        return np.zeros(0, dtype=np.int64)
    left = np.concatenate([[-np.inf], f[:-1]])
    right = np.concatenate([f[1:], [-np.inf]])
    return np.flatnonzero((f > left) & (f >= right) & (f >= floor * f.max()))


def find_valleys(f: np.ndarray, modes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Between consecutive modes: the index of the minimum and its depth
    ``(min(peak_left, peak_right) - valley) / max(f)``."""
    idx, depth = [], []
    top = float(np.max(f)) if len(f) else 0.0
    for a, b in zip(modes[:-1], modes[1:]):
        v = int(a + np.argmin(f[a:b + 1]))
        idx.append(v)
        depth.append((min(f[a], f[b]) - f[v]) / top if top > 0 else 0.0)
    return np.array(idx, dtype=np.int64), np.array(depth, dtype=np.float64)


# --- analysis -------------------------------------------------------------------------------------
@dataclass
class Analysis:
    rule: str
    layers: list[int]
    thresholds: tuple[float, float]
    warning: str
    observed_shares: dict[str, float]
    per_layer: list[dict[str, Any]]
    intersection: list[int]  # ∩_p L*[p]
    n_prompts_used: int
    target_shares: dict[str, float] | None
    kde: dict[str, Any]  # densities for the plot (window grid, per-layer mixture, ū)
    thought_types: int = 3  # how many types ThinKV labels with these thresholds (1: all tokens one type)
    per_prompt_kde: np.ndarray | None = None  # [P, L, len(kde["x"])] (in memory only, for the plot)


def _check_shares(shares: dict[str, float] | None) -> dict[str, float]:
    s = dict(DEFAULT_TARGET_SHARES if shares is None else shares)
    if set(s) != set(TYPES):
        raise TrtkvError(f"target shares need exactly the keys E, R, T (got {', '.join(sorted(s)) or 'none'})")
    try:
        s = {k: float(v) for k, v in s.items()}
    except (TypeError, ValueError):
        raise TrtkvError("target shares must be numbers") from None
    if any(not math.isfinite(v) or v <= 0 for v in s.values()):
        raise TrtkvError(f"target shares must be positive: {s}")
    tot = sum(s.values())
    if abs(tot - 1.0) > 1e-6:
        raise TrtkvError(f"target shares must sum to 1 (got {tot:g})")
    return s


def parse_shares(text: str) -> dict[str, float]:
    """``"E=0.2,R=0.6,T=0.2"`` -> dict (validated)."""
    out = {}
    for part in text.replace(";", ",").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise TrtkvError(f"target shares {text!r}: expected E=..,R=..,T=..")
        k, v = part.split("=", 1)
        try:
            out[k.strip().upper()] = float(v)
        except ValueError:
            raise TrtkvError(f"target shares {text!r}: {v!r} is not a number") from None
    return _check_shares(out)


def classify_shares(u_bar: np.ndarray, thresholds: Sequence[float]) -> dict[str, float]:
    """Share of steps labelled E (ū < θ_low), R (θ_low ≤ ū < θ_high), T (ū ≥ θ_high)."""
    u_bar = np.asarray(u_bar, dtype=np.float64)
    u_bar = u_bar[np.isfinite(u_bar)]
    if len(u_bar) == 0:
        return {"E": 0.0, "R": 0.0, "T": 0.0}
    lo, hi = thresholds
    e = float(np.mean(u_bar < lo))
    t = float(np.mean(u_bar >= hi))
    return {"E": round(e, 6), "R": round(1.0 - e - t, 6), "T": round(t, 6)}


def pooled_u_bar(u: Sequence[np.ndarray], layers: Sequence[int]) -> np.ndarray:
    """ū per recorded step (mean over ``layers``, as decode computes it), pooled over prompts."""
    parts = [np.nanmean(np.asarray(x)[:, list(layers)], axis=1) for x in u if len(x)]
    return np.concatenate(parts) if parts else np.zeros(0)


def _window(u: Sequence[np.ndarray], extra: Sequence[float]) -> tuple[float, float]:
    vals = np.concatenate([np.asarray(x).ravel() for x in u if len(x)] + [np.zeros(0)])
    vals = vals[np.isfinite(vals)]
    if len(vals) == 0:
        return 0.0, 1.0
    lo, hi = np.quantile(vals, [0.001, 0.999])
    lo, hi = min([lo, *extra]), max([hi, *extra])
    pad = max(0.02, 0.08 * (hi - lo))
    return max(0.0, float(lo) - pad), min(1.0, float(hi) + pad)


def _sig(a, digits: int = 5) -> list[float]:
    return [float(f"{v:.{digits}g}") for v in np.asarray(a, dtype=np.float64).ravel()]


def analyze(u: Sequence[np.ndarray], num_layers: int = DEFAULT_NUM_LAYERS,
            target_shares: dict[str, float] | None = None, min_support: float = 0.5,
            keep_per_prompt: bool = False, fallback_types: int = 1) -> Analysis:
    """Algorithm 1 on recorded sparsities: ``u[p]`` is ``[steps, layers]`` for prompt ``p``.
    ``fallback_types``: thought types ThinKV uses when no layer is tri-modal (1 or 3)."""
    shares = _check_shares(target_shares)
    if fallback_types not in THOUGHT_TYPE_COUNTS:
        raise TrtkvError(f"fallback thought types must be 1 or 3, got {fallback_types}")
    if num_layers < 1:
        raise TrtkvError(f"the number of calibration layers must be positive, got {num_layers}")
    if not 0.0 < min_support <= 1.0:
        raise TrtkvError(f"min_support must be in (0, 1], got {min_support}")
    u = [np.asarray(x, dtype=np.float64).reshape(len(x), -1) if len(x) else np.asarray(x, dtype=np.float64)
         for x in u]
    widths = {x.shape[1] for x in u if x.ndim == 2 and len(x)}
    if not widths:
        raise TrtkvError("calibration recorded no sparsity at all: generations were shorter than min_keys "
                         "keys or ended at once; raise --max-tokens or lower min_keys")
    if len(widths) > 1:
        raise TrtkvError(f"calibration data has prompts with different layer counts {sorted(widths)}")
    L = widths.pop()
    used = [x for x in u if x.ndim == 2 and len(x) >= MIN_POINTS]
    if not used:
        raise TrtkvError(f"no prompt produced at least {MIN_POINTS} recorded decode steps; raise --max-tokens "
                         "or lower --stride / min_keys")
    P = len(used)
    grid = np.linspace(0.0, 1.0, GRID_POINTS)
    modes = np.zeros((P, L), dtype=np.int64)
    depth = np.zeros((P, L))
    valleys: dict[tuple[int, int], np.ndarray] = {}
    sd_within = np.zeros((P, L))
    lag1 = np.zeros((P, L))  # diagnostic: persistence of the per-step sparsity between recorded steps
    dens = np.zeros((P, L, GRID_POINTS))
    for p, x in enumerate(used):
        for layer in range(L):
            col = x[:, layer]
            f, _ = kde_on_grid(col, grid)
            m = find_modes(f)
            modes[p, layer] = len(m)
            vi, vd = find_valleys(f, m)
            depth[p, layer] = float(vd.mean()) if len(vd) else 0.0
            if len(m) == N_THOUGHT_TYPES:
                valleys[(p, layer)] = grid[vi]
            finite = col[np.isfinite(col)]
            sd_within[p, layer] = float(finite.std()) if len(finite) else 0.0
            if len(finite) > 2 and finite[1:].std() > 0 and finite[:-1].std() > 0:
                lag1[p, layer] = float(np.corrcoef(finite[1:], finite[:-1])[0, 1])
            area = np.trapz(f, grid)
            dens[p, layer] = f / area if area > 0 else f
    three = (modes == N_THOUGHT_TYPES).sum(0)
    depth_l = np.array([depth[modes[:, layer] == N_THOUGHT_TYPES, layer].mean() if three[layer]
                        else depth[:, layer].mean() for layer in range(L)])
    score_sd = sd_within.mean(0)
    intersection = [int(layer) for layer in range(L) if three[layer] == P]
    rank = sorted(range(L), key=lambda layer: (-three[layer], -depth_l[layer], -score_sd[layer], layer))
    need = max(1, math.ceil(min_support * P - 1e-9))
    k = min(num_layers, L)
    warnings: list[str] = []
    tshares = None
    types = N_THOUGHT_TYPES
    if three[rank[0]] >= need:
        rule = RULE_KDE
        chosen = [layer for layer in rank[:k] if three[layer] >= need]
        if len(chosen) < num_layers:
            warnings.append(f"only {len(chosen)} layer(s) show {N_THOUGHT_TYPES} sparsity modes on at least "
                            f"{need} of {P} prompts (asked for {num_layers}); using {len(chosen)}")
        pairs = [valleys[(p, layer)] for layer in chosen for p in range(P) if (p, layer) in valleys]
        th = np.mean(pairs, axis=0)
        lo, hi = float(th[0]), float(th[1])
        if not lo < hi:
            raise TrtkvError(f"calibration produced thresholds that are not increasing ({lo:.4f}, {hi:.4f})")
        if len(intersection) != num_layers:
            warnings.append(f"∩_p L*[p] has {len(intersection)} layer(s), not {num_layers}: layers picked by "
                            "the ranking fallback (3-mode prompt count, then valley depth)")
    else:
        rule = RULE_FALLBACK
        tshares = shares
        types = fallback_types
        chosen = sorted(range(L), key=lambda layer: (-score_sd[layer], layer))[:k]
        ub = pooled_u_bar(used, chosen)
        ub = ub[np.isfinite(ub)]
        lo = float(np.quantile(ub, shares["E"]))
        hi = float(np.quantile(ub, 1.0 - shares["T"]))
        if not hi > lo:
            hi = float(np.nextafter(lo, 2.0)) if lo < 1.0 else lo
            lo = float(np.nextafter(hi, -1.0)) if hi <= lo else lo
            warnings.append("the pooled sparsity is (nearly) constant: the target shares cannot be matched")
        best = rank[0]
        warnings.insert(0, (
            f"NO LAYER IS TRI-MODAL: the best layer ({best}) has {N_THOUGHT_TYPES} sparsity modes on "
            f"{int(three[best])} of {P} prompts (need {need}). This model does not show ThinKV's thought "
            f"structure; thresholds are quantiles of the mean sparsity of the {len(chosen)} most variable "
            f"layers {sorted(chosen)}, placed so that E/R/T shares are "
            f"{shares['E']:.2f}/{shares['R']:.2f}/{shares['T']:.2f} on the calibration data. "
            + ("ThinKV therefore treats every token as ONE thought type (the paper's §E.10 setting for LLMs: "
               "4-bit, eviction only at the budget); `--set thought_types=3` labels by the quantile bands instead."
               if types == 1 else "The labels are sparsity bands, not evidence of thought types.")))
    thresholds = (lo, hi)
    ub_all = pooled_u_bar(used, chosen)
    observed = classify_shares(ub_all, thresholds)

    # densities for the plot, on a window around the data
    wlo, whi = _window(used, thresholds)
    xs = np.linspace(wlo, whi, KDE_STORE_POINTS)
    per_prompt = np.stack([[np.interp(xs, grid, dens[p, layer]) for layer in range(L)] for p in range(P)])
    mix = per_prompt.mean(0)
    f_ub, _ = kde_on_grid(ub_all, grid)
    area = np.trapz(f_ub, grid)
    f_ub = np.interp(xs, grid, f_ub / area if area > 0 else f_ub)
    kde = {"x": _sig(xs, 6), "layers": [_sig(mix[layer]) for layer in range(L)], "u_bar": _sig(f_ub)}

    per_layer = []
    for layer in range(L):
        col = np.concatenate([x[:, layer] for x in used])
        col = col[np.isfinite(col)]
        vs = [valleys[(p, layer)] for p in range(P) if (p, layer) in valleys]
        per_layer.append({
            "layer": layer,
            "modes_per_prompt": [int(v) for v in modes[:, layer]],
            "three_mode_prompts": int(three[layer]),
            "mean_sparsity": round(float(col.mean()), 6) if len(col) else None,
            "sd_sparsity": round(float(col.std()), 6) if len(col) else None,
            "within_prompt_sd": round(float(score_sd[layer]), 6),
            "lag1_autocorr": round(float(lag1[:, layer].mean()), 4),
            "valley_depth": round(float(depth_l[layer]), 6),
            "valleys": [round(float(v), 6) for v in np.mean(vs, axis=0)] if vs else None,
            "chosen": layer in chosen,
        })
    return Analysis(rule, sorted(int(c) for c in chosen), (lo, hi), " ".join(warnings), observed, per_layer,
                    intersection, P, tshares, kde, types, per_prompt if keep_per_prompt else None)


# --- artifact -------------------------------------------------------------------------------------
def make_artifact(analysis: Analysis, data: CalibrationData | None, model: str,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from trtkv import __version__

    meta = data.meta if data is not None else {}
    art: dict[str, Any] = {
        "version": ARTIFACT_VERSION,
        "model": model,
        "sparsity_def_version": SPARSITY_DEF_VERSION,
        "rel_threshold": REL_THRESHOLD,
        "layers": list(analysis.layers),
        "thresholds": [float(analysis.thresholds[0]), float(analysis.thresholds[1])],
        "rule": analysis.rule,
        "thought_types": analysis.thought_types,
        "warning": analysis.warning,
        "n_prompts": len(data.u) if data is not None else analysis.n_prompts_used,
        "n_prompts_used": analysis.n_prompts_used,
        "max_tokens": meta.get("max_tokens"),
        "step_stride": meta.get("step_stride"),
        "min_keys": meta.get("min_keys"),
        "sampling": meta.get("sampling"),
        "target_shares": analysis.target_shares,
        "observed_shares": analysis.observed_shares,
        "intersection": analysis.intersection,
        "kde": {"kernel": "gaussian", "bandwidth": "scott", "grid_points": GRID_POINTS,
                "mode_floor": MODE_FLOOR, **analysis.kde},
        "per_layer": analysis.per_layer,
        "kv_amax": ({"k": _sig(data.k_amax, 7), "v": _sig(data.v_amax, 7)} if data is not None else None),
        "stats": ({"recorded_steps": int(sum(len(x) for x in data.u)),
                   "generated_tokens": int(sum(data.generated_tokens)),
                   "collect_s": meta.get("collect_s")} if data is not None else None),
        "trtkv_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    art.update(extra or {})
    return art


def _bad(where: str, msg: str) -> TrtkvError:
    return TrtkvError(f"invalid calibration {where}: {msg}; rerun `trtkv calibrate`")


def load_calibration(src: str | Path | dict[str, Any], num_layers: int | None = None) -> dict[str, Any]:
    """Read and validate a calibration artifact (a path to its JSON, or the dict itself).

    Checks the version, the sparsity definition, the layers (distinct, in range when ``num_layers`` is
    given), the thresholds (two finite numbers in [0, 1], strictly increasing), the rule and ``kv_amax``
    (optional; per layer, finite and non-negative). Returns the dict with normalised types."""
    where = "data"
    if isinstance(src, (str, Path)):
        where = f"file {src}"
        p = Path(src)
        if not p.is_file():
            raise TrtkvError(f"calibration file {p} not found; create it with `trtkv calibrate MODEL --out {p}`")
        try:
            src = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(where, f"not JSON ({e})") from None
    if not isinstance(src, dict):
        raise _bad(where, "expected a JSON object")
    c = dict(src)
    if c.get("version") != ARTIFACT_VERSION:
        raise _bad(where, f"version {c.get('version')!r} is not supported (expects {ARTIFACT_VERSION})")
    if c.get("sparsity_def_version") != SPARSITY_DEF_VERSION:
        raise _bad(where, f"sparsity definition {c.get('sparsity_def_version')!r} differs from this trtkv's "
                          f"{SPARSITY_DEF_VERSION!r}")
    layers = c.get("layers")
    if (not isinstance(layers, list) or not layers
            or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers)):
        raise _bad(where, f"'layers' must be a non-empty list of layer indices, got {layers!r}")
    if len(set(layers)) != len(layers):
        raise _bad(where, f"'layers' has duplicates: {layers}")
    if num_layers is not None and max(layers) >= num_layers:
        raise _bad(where, f"layer {max(layers)} does not exist in a model with {num_layers} layers")
    th = c.get("thresholds")
    if (not isinstance(th, list) or len(th) != 2
            or any(not isinstance(x, (int, float)) or isinstance(x, bool) for x in th)):
        raise _bad(where, f"'thresholds' must be two numbers [low, high], got {th!r}")
    lo, hi = float(th[0]), float(th[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 <= lo < hi <= 1.0):
        raise _bad(where, f"'thresholds' must satisfy 0 <= low < high <= 1, got {th}")
    types = c.get("thought_types", N_THOUGHT_TYPES)  # artifacts before this field: 3
    if types not in THOUGHT_TYPE_COUNTS or isinstance(types, bool):
        raise _bad(where, f"'thought_types' must be 1 or 3, got {types!r}")
    c["thought_types"] = int(types)
    if c.get("rule") not in RULES:
        raise _bad(where, f"'rule' must be one of {', '.join(RULES)}, got {c.get('rule')!r}")
    if not isinstance(c.get("warning", ""), str):
        raise _bad(where, "'warning' must be a string")
    rel = c.get("rel_threshold", REL_THRESHOLD)
    if not isinstance(rel, (int, float)) or abs(float(rel) - REL_THRESHOLD) > 1e-12:
        raise _bad(where, f"'rel_threshold' {rel!r} differs from {REL_THRESHOLD}")
    amax = c.get("kv_amax")
    if amax is not None:
        if not isinstance(amax, dict) or set(amax) != {"k", "v"}:
            raise _bad(where, "'kv_amax' must be {\"k\": [...], \"v\": [...]}")
        for key in ("k", "v"):
            vals = amax[key]
            if (not isinstance(vals, list) or not vals
                    or any(not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0
                           for x in vals)):
                raise _bad(where, f"'kv_amax.{key}' must be a list of finite non-negative numbers")
        if len(amax["k"]) != len(amax["v"]):
            raise _bad(where, "'kv_amax' k and v have different lengths")
        if num_layers is not None and len(amax["k"]) != num_layers:
            raise _bad(where, f"'kv_amax' has {len(amax['k'])} layers, the model has {num_layers}")
        c["kv_amax"] = {"k": [float(x) for x in amax["k"]], "v": [float(x) for x in amax["v"]]}
    c["layers"] = [int(x) for x in layers]
    c["thresholds"] = [lo, hi]
    c.setdefault("warning", "")
    return c


def save_calibration(artifact: dict[str, Any], path: str | Path) -> Path:
    load_calibration(artifact)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(artifact, indent=1) + "\n")
    tmp.replace(path)
    return path


def layer_scales(calibration: dict[str, Any] | None, fmt: str, num_layers: int) -> list:
    """Static per-layer ``LayerScales`` for format ``fmt`` from the artifact's ``kv_amax`` (1.0 without)."""
    from plugins.formats import LayerScales, get_format
    from plugins.formats.quantized import calibrate_layer_scales

    amax = (calibration or {}).get("kv_amax")
    if not amax:
        return [LayerScales() for _ in range(num_layers)]
    f = get_format(fmt)
    return [calibrate_layer_scales(float(k), float(v), f) for k, v in zip(amax["k"], amax["v"])]


def packaged_calibration(alias: str) -> Path | None:
    """``configs/calibration/<alias>.json`` when the repository ships one for this model alias."""
    from trtkv.paths import CONFIGS_DIR

    p = CONFIGS_DIR / "calibration" / f"{Path(alias).name}.json"
    return p if p.is_file() else None


def summary_lines(art: dict[str, Any]) -> list[str]:
    """Human-readable summary; the warning (if any) framed so it cannot be missed."""
    sh = art.get("observed_shares") or {}
    types = art.get("thought_types", N_THOUGHT_TYPES)
    lines = [f"calibration of {art.get('model')}: rule {art['rule']}, layers {art['layers']}, "
             f"thresholds θ_low={art['thresholds'][0]:.4f} θ_high={art['thresholds'][1]:.4f}, "
             + ("3 thought types (R/E/T)" if types == 3 else "1 thought type (no labels; paper §E.10)"),
             f"  {'observed' if types == 3 else 'quantile-band'} shares on the calibration data: "
             f"E {sh.get('E', 0):.3f}  R {sh.get('R', 0):.3f}  "
             f"T {sh.get('T', 0):.3f}  ({art.get('n_prompts_used', art.get('n_prompts'))} prompts)"]
    if art.get("target_shares"):
        ts = art["target_shares"]
        lines.append(f"  target shares: E {ts['E']:.3f}  R {ts['R']:.3f}  T {ts['T']:.3f}")
    per_layer = art.get("per_layer", [])
    tri = [(d["layer"], d["three_mode_prompts"]) for d in per_layer if d["three_mode_prompts"]]
    if tri:
        best = sorted(tri, key=lambda t: (-t[1], t[0]))[:6]
        lines.append("  layers with most 3-mode prompts (layer:prompts): "
                     + ", ".join(f"{layer}:{n}" for layer, n in best))
    elif per_layer:
        counts = np.bincount(np.concatenate([np.minimum(d["modes_per_prompt"], 4) for d in per_layer]),
                             minlength=5)
        lines.append("  no (prompt, layer) has 3 modes; KDE mode counts over all pairs: "
                     + ", ".join(f"{k if k < 4 else '4+'}: {int(c)}" for k, c in enumerate(counts) if c))
    if art.get("warning"):
        bar = "!" * 78
        lines += [bar, "WARNING (calibration): " + art["warning"], bar]
    return lines


# --- engines --------------------------------------------------------------------------------------
def _is_engine_dir(p: Path) -> bool:
    return p.is_dir() and (p / "engine.json").is_file()


class _FullEngine:
    """Context manager: a FullKV ``Engine`` for ``model`` (alias, checkpoint dir or engine dir) in a
    temporary directory that is removed afterwards. An existing engine is re-used through a copy of its
    manifest with the ``full`` policy at the model's dtype (so a quantized engine calibrates on exact KV)."""

    def __init__(self, model: str, device: str | None = None, dtype: str | None = None, synthetic: bool = False,
                 seed: int = 0, quiet: bool = True):
        self.model, self.device, self.dtype = model, device, dtype
        self.synthetic, self.seed, self.quiet = synthetic, seed, quiet
        self.tmp: Path | None = None
        self.alias = model
        self.weights_sha256 = None

    def __enter__(self):
        import torch

        from trtkv.api import Engine
        from trtkv.build.engine_dir import read_manifest, write_manifest

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tmp = Path(tempfile.mkdtemp(prefix="trtkv-calib-"))
        src = Path(self.model).expanduser()
        if _is_engine_dir(src):
            m = read_manifest(src)
            m.pop("format_version", None)
            m["policy"] = {"name": "full", "params": {}}
            m["cache"] = {**m["cache"], "residual_group": 1, "eviction": "inplace", "max_pages": None}
            m["calibration"] = None
            path = self.tmp / "engine"
            path.mkdir()
            for sub in ("weights", "tokenizer"):
                if (src / sub).exists():
                    (path / sub).symlink_to((src / sub).resolve(), target_is_directory=True)
            write_manifest(path, m)
        else:
            from trtkv.build.builder import build_engine, default_dtype

            path = build_engine(self.model, "full", self.tmp / "engine", dtype=self.dtype or default_dtype(device),
                                synthetic=self.synthetic, device=device, seed=self.seed, quiet=self.quiet)
        eng = Engine.load(path, device=device)
        self.alias = eng.manifest["model"]["alias"]
        self.weights_sha256 = eng.manifest["model"].get("weights_sha256")
        return eng

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def open_full_engine(model: str, device: str | None = None, dtype: str | None = None, synthetic: bool = False,
                     seed: int = 0, quiet: bool = True) -> _FullEngine:
    return _FullEngine(model, device, dtype, synthetic, seed, quiet)


def load_prompts(n: int, data: str | Path | None = None) -> tuple[list[str], list[str]]:
    """The first ``n`` calibration prompts (``load_task("calibration")``; ``data`` overrides the file)."""
    from trtkv.eval.datasets import DataFileNotFoundError, load_task

    if n < 1:
        raise TrtkvError(f"--prompts must be positive, got {n}")
    try:
        probs = load_task("calibration", data, limit=n)
    except DataFileNotFoundError as e:
        raise TrtkvError(str(e)) from None
    except (KeyError, ValueError) as e:
        raise TrtkvError(f"cannot read calibration prompts from {data}: {e}") from None
    if not probs:
        raise TrtkvError(f"no calibration prompts in {data or 'the calibration set'}")
    return [p.question for p in probs], [p.id for p in probs]


def save_raw(data: CalibrationData, path: str | Path) -> Path:
    """The recorded per-step sparsities and K/V amax as ``.npz`` (re-analyse with ``trtkv calibrate
    --from-raw`` without generating again)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"u_{i}": x for i, x in enumerate(data.u)}
    arrays.update({f"steps_{i}": x for i, x in enumerate(data.steps)})
    meta = {**data.meta, "prompt_ids": data.prompt_ids, "generated_tokens": data.generated_tokens,
            "n": len(data.u)}
    with open(path, "wb") as f:
        np.savez_compressed(f, k_amax=data.k_amax, v_amax=data.v_amax, meta=np.array(json.dumps(meta)), **arrays)
    return path


def load_raw(path: str | Path) -> CalibrationData:
    try:
        z = np.load(Path(path), allow_pickle=False)
        meta = json.loads(str(z["meta"]))
        n = int(meta.pop("n"))
        u = [z[f"u_{i}"] for i in range(n)]
        steps = [z[f"steps_{i}"] for i in range(n)]
        ids, gen = meta.pop("prompt_ids"), meta.pop("generated_tokens")
        return CalibrationData(u, steps, z["k_amax"], z["v_amax"], ids, gen, meta)
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise TrtkvError(f"cannot read raw calibration data {path}: {e}") from None


def calibrate(model: str, n_prompts: int = 100, max_tokens: int = 1024, stride: int = 1,
              num_layers: int = DEFAULT_NUM_LAYERS, data: str | Path | None = None,
              min_keys: int = DEFAULT_MIN_KEYS, batch_size: int | None = None, temperature: float | None = None,
              seed: int = 0, target_shares: dict[str, float] | None = None, min_support: float = 0.5,
              device: str | None = None, dtype: str | None = None, synthetic: bool = False,
              plot: str | Path | None = None, log: Log | None = None, quiet: bool = True,
              raw_out: str | Path | None = None, raw_in: str | Path | None = None,
              fallback_types: int = 1) -> dict[str, Any]:
    """Collect on ``model`` and analyse; returns the artifact (and writes ``plot`` if given).

    ``raw_out`` also saves the recorded data (:func:`save_raw`); ``raw_in`` skips the collection and
    re-analyses saved data (``model`` then only names the model in the artifact)."""
    import torch

    t0 = time.perf_counter()
    if raw_in is not None:
        cdata = load_raw(raw_in)
        alias = str(cdata.meta.get("model") or model)
        extra = {k: cdata.meta.get(k) for k in ("weights_sha256", "dtype", "device")}
    else:
        prompts, ids = load_prompts(n_prompts, data)
        if batch_size is None:
            dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
            batch_size = 32 if dev.startswith("cuda") else 8
        opener = open_full_engine(model, device, dtype, synthetic, seed, quiet)
        with opener as eng:
            if log:
                log(f"[calibrate] {opener.alias}: {len(prompts)} prompts x {max_tokens} tokens, stride {stride}, "
                    f"min_keys {min_keys}, batch {batch_size}, {eng.manifest['model']['dtype']} on "
                    f"{eng.core.device}")
            cdata = collect_sparsity(eng, prompts, max_tokens, stride, min_keys, batch_size, temperature, seed,
                                     ids, log)
            alias = opener.alias
            extra = {"weights_sha256": opener.weights_sha256, "dtype": str(eng.core.dtype).replace("torch.", ""),
                     "device": str(eng.core.device)}
        cdata.meta.update(model=alias, **extra)
        if raw_out is not None:
            save_raw(cdata, raw_out)
    an = analyze(cdata.u, num_layers, target_shares, min_support, keep_per_prompt=plot is not None,
                 fallback_types=fallback_types)
    art = make_artifact(an, cdata, alias, {**extra, "num_layers_requested": num_layers, "min_support": min_support})
    art["stats"]["wall_s"] = round(time.perf_counter() - t0, 2)
    load_calibration(art)
    if plot is not None:
        from trtkv.build.calibration_plot import plot_calibration

        plot_calibration(art, plot, an.per_prompt_kde)
    return art


def calibrate_for_build(model: str, *, device: str = "cpu", dtype: str | None = None, synthetic: bool = False,
                        seed: int = 0, n_prompts: int | None = None, max_tokens: int | None = None,
                        stride: int = 1, num_layers: int = DEFAULT_NUM_LAYERS, data: str | Path | None = None,
                        target_shares: dict[str, float] | None = None, reuse: bool = True,
                        num_model_layers: int | None = None, log: Log | None = None,
                        quiet: bool = True) -> dict[str, Any]:
    """The calibration ``trtkv build --policy thinkv`` embeds in ``engine.json`` when no file is given.

    With ``reuse`` (default) and real weights, a calibration the repository ships for this alias
    (``configs/calibration/<alias>.json``) is returned as is; otherwise a fresh one is run, sized for the
    device when not given: 16 prompts × 192 tokens on CPU, 100 prompts × 2,048 tokens on CUDA (the paper
    uses 100 s1K prompts and up to 32K tokens). Any warning is printed through ``log``."""
    if reuse and not synthetic:
        p = packaged_calibration(model)
        if p is not None:
            art = load_calibration(p, num_model_layers)
            if log:
                log(f"[calibrate] using the shipped calibration {p}")
                for line in summary_lines(art):
                    log(line)
            return art
    cuda = str(device).startswith("cuda")
    art = calibrate(model, n_prompts or (100 if cuda else 16), max_tokens or (2048 if cuda else 192), stride,
                    num_layers, data, device=device, dtype=dtype, synthetic=synthetic, seed=seed,
                    target_shares=target_shares, log=log, quiet=quiet)
    if log:
        for line in summary_lines(art):
            log(line)
    return art


__all__ = ["CalibrationData", "Analysis", "collect_sparsity", "analyze", "make_artifact", "load_calibration",
           "save_calibration", "calibrate", "calibrate_for_build", "classify_shares", "kde_on_grid", "find_modes",
           "find_valleys", "layer_scales", "packaged_calibration", "summary_lines", "parse_shares",
           "open_full_engine", "load_prompts", "save_raw", "load_raw", "SPARSITY_DEF_VERSION", "RULE_KDE",
           "RULE_FALLBACK", "DEFAULT_TARGET_SHARES"]
