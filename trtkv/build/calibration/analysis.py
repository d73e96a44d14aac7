"""Algorithm 1 on recorded sparsities: which layers separate the thought types, and the two thresholds.

**Rule ``kde-valleys``** (spec §2.3). Per (prompt, layer) a KDE (``density.py``) and its modes. ``L*[p]``
are the layers with exactly 3 modes; layers are ranked by the number of prompts on which they have 3
modes, ties broken by the mean normalised valley depth, then by within-prompt variability; the top
``num_layers`` whose 3-mode support reaches ``min_support`` of the prompts are ``L*`` (this equals
``∩_p L*[p]`` when that intersection has exactly ℓ* layers). Fewer qualifying layers are taken as they
are, with a warning (the paper: "can be less than |L*|"). Thresholds are the KDE minima between
consecutive modes, averaged over the (layer ∈ L*, prompt) pairs with 3 modes.

**Rule ``fallback-quantiles``**, when no layer is tri-modal on ``min_support`` of the prompts (measured on
SmolLM2-135M, not a reasoning model; see ``shared/specs/thinkv-small-models.md``): ``L*`` = the layers
with the largest *mean within-prompt* standard deviation of the per-step sparsity — a thought label is a
per-step decision inside one generation, so only variation during a generation can separate types
(between-prompt offsets would only shift whole prompts into one class). ``ū`` (the mean over ``L*``,
what decode computes) is pooled and cut at the ``share_E`` and ``1 - share_T`` quantiles, so that
E: ū < θ_low, R: θ_low ≤ ū < θ_high, T: ū ≥ θ_high reproduce the target shares (default E 0.2 / R 0.6 /
T 0.2; the paper's average precisions of 3.4-3.9 bits under R4E4T2 imply a T share of 0.05-0.30).
Such a model uses ONE thought type by default (the paper's §E.10 setting for LLMs; three quantile
bands put 2-bit ternary on 37-50% of a SmolLM2 generation and the text fell apart, docs/benchmarks.md);
``fallback_types=3`` keeps the bands.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtkv.artifacts.calibration import (N_THOUGHT_TYPES, RULE_FALLBACK, RULE_KDE, RULES,  # noqa: F401 (re-exported)
                                         THOUGHT_TYPE_COUNTS, TYPES)
from trtkv.build.calibration.density import GRID_POINTS, find_modes, find_valleys, kde_on_grid
from trtkv.errors import TrtkvError

DEFAULT_TARGET_SHARES = {"E": 0.2, "R": 0.6, "T": 0.2}
DEFAULT_NUM_LAYERS = 4
MIN_POINTS = 8  # a (prompt, layer) with fewer recorded steps is left out of the analysis
KDE_STORE_POINTS = 241  # densities kept in the artifact (for the plot), over the data's window

# numpy 2 renamed trapz (gone in 2.4); the pinned numpy<2 has only the old name
trapezoid = getattr(np, "trapezoid", None) or np.trapz


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


@dataclass
class _PairStats:
    """Per (prompt, layer): KDE mode count, mean valley depth, valleys of 3-mode pairs, spread, density."""

    modes: np.ndarray  # [P, L]
    depth: np.ndarray  # [P, L]
    valleys: dict[tuple[int, int], np.ndarray]
    sd_within: np.ndarray  # [P, L]
    lag1: np.ndarray  # [P, L] persistence of the per-step sparsity between recorded steps (diagnostic)
    dens: np.ndarray  # [P, L, GRID_POINTS], normalised to area 1


def _pair_stats(used: list[np.ndarray], L: int, grid: np.ndarray) -> _PairStats:
    P = len(used)
    st = _PairStats(np.zeros((P, L), dtype=np.int64), np.zeros((P, L)), {}, np.zeros((P, L)), np.zeros((P, L)),
                    np.zeros((P, L, len(grid))))
    for p, x in enumerate(used):
        for layer in range(L):
            col = x[:, layer]
            f, _ = kde_on_grid(col, grid)
            m = find_modes(f)
            st.modes[p, layer] = len(m)
            vi, vd = find_valleys(f, m)
            st.depth[p, layer] = float(vd.mean()) if len(vd) else 0.0
            if len(m) == N_THOUGHT_TYPES:
                st.valleys[(p, layer)] = grid[vi]
            finite = col[np.isfinite(col)]
            st.sd_within[p, layer] = float(finite.std()) if len(finite) else 0.0
            if len(finite) > 2 and finite[1:].std() > 0 and finite[:-1].std() > 0:
                st.lag1[p, layer] = float(np.corrcoef(finite[1:], finite[:-1])[0, 1])
            area = trapezoid(f, grid)
            st.dens[p, layer] = f / area if area > 0 else f
    return st


def _check_inputs(u: Sequence[np.ndarray], num_layers: int, min_support: float, fallback_types: int
                  ) -> tuple[list[np.ndarray], int]:
    """The prompts with enough recorded steps, and the layer count (one clear error for unusable data)."""
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
    used = [x for x in u if x.ndim == 2 and len(x) >= MIN_POINTS]
    if not used:
        raise TrtkvError(f"no prompt produced at least {MIN_POINTS} recorded decode steps; raise --max-tokens "
                         "or lower --stride / min_keys")
    return used, widths.pop()


def _kde_rule(st: _PairStats, rank: list[int], three: np.ndarray, need: int, num_layers: int, k: int,
              intersection: list[int], warnings: list[str]) -> tuple[list[int], float, float]:
    P = st.modes.shape[0]
    chosen = [layer for layer in rank[:k] if three[layer] >= need]
    if len(chosen) < num_layers:
        warnings.append(f"only {len(chosen)} layer(s) show {N_THOUGHT_TYPES} sparsity modes on at least "
                        f"{need} of {P} prompts (asked for {num_layers}); using {len(chosen)}")
    pairs = [st.valleys[(p, layer)] for layer in chosen for p in range(P) if (p, layer) in st.valleys]
    th = np.mean(pairs, axis=0)
    lo, hi = float(th[0]), float(th[1])
    if not lo < hi:
        raise TrtkvError(f"calibration produced thresholds that are not increasing ({lo:.4f}, {hi:.4f})")
    if len(intersection) != num_layers:
        warnings.append(f"∩_p L*[p] has {len(intersection)} layer(s), not {num_layers}: layers picked by "
                        "the ranking fallback (3-mode prompt count, then valley depth)")
    return chosen, lo, hi


def _fallback_rule(used: list[np.ndarray], score_sd: np.ndarray, shares: dict[str, float], k: int, best: int,
                   best_three: int, need: int, types: int, warnings: list[str]) -> tuple[list[int], float, float]:
    P, L = len(used), len(score_sd)
    chosen = sorted(range(L), key=lambda layer: (-score_sd[layer], layer))[:k]
    ub = pooled_u_bar(used, chosen)
    ub = ub[np.isfinite(ub)]
    lo = float(np.quantile(ub, shares["E"]))
    hi = float(np.quantile(ub, 1.0 - shares["T"]))
    if not hi > lo:
        hi = float(np.nextafter(lo, 2.0)) if lo < 1.0 else lo
        lo = float(np.nextafter(hi, -1.0)) if hi <= lo else lo
        warnings.append("the pooled sparsity is (nearly) constant: the target shares cannot be matched")
    warnings.insert(0, (
        f"NO LAYER IS TRI-MODAL: the best layer ({best}) has {N_THOUGHT_TYPES} sparsity modes on "
        f"{best_three} of {P} prompts (need {need}). This model does not show ThinKV's thought "
        f"structure; thresholds are quantiles of the mean sparsity of the {len(chosen)} most variable "
        f"layers {sorted(chosen)}, placed so that E/R/T shares are "
        f"{shares['E']:.2f}/{shares['R']:.2f}/{shares['T']:.2f} on the calibration data. "
        + ("ThinKV therefore treats every token as ONE thought type (the paper's §E.10 setting for LLMs: "
           "4-bit, eviction only at the budget); `--set thought_types=3` labels by the quantile bands instead."
           if types == 1 else "The labels are sparsity bands, not evidence of thought types.")))
    return chosen, lo, hi


def _plot_densities(used: list[np.ndarray], st: _PairStats, ub_all: np.ndarray, thresholds: tuple[float, float],
                    grid: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """Densities for the plot on a window around the data: per-layer mean over prompts, and ū's."""
    P, L = st.modes.shape
    wlo, whi = _window(used, thresholds)
    xs = np.linspace(wlo, whi, KDE_STORE_POINTS)
    per_prompt = np.stack([[np.interp(xs, grid, st.dens[p, layer]) for layer in range(L)] for p in range(P)])
    mix = per_prompt.mean(0)
    f_ub, _ = kde_on_grid(ub_all, grid)
    area = trapezoid(f_ub, grid)
    f_ub = np.interp(xs, grid, f_ub / area if area > 0 else f_ub)
    return {"x": _sig(xs, 6), "layers": [_sig(mix[layer]) for layer in range(L)], "u_bar": _sig(f_ub)}, per_prompt


def _per_layer(used: list[np.ndarray], st: _PairStats, three: np.ndarray, depth_l: np.ndarray,
               score_sd: np.ndarray, chosen: list[int]) -> list[dict[str, Any]]:
    P, L = st.modes.shape
    out = []
    for layer in range(L):
        col = np.concatenate([x[:, layer] for x in used])
        col = col[np.isfinite(col)]
        vs = [st.valleys[(p, layer)] for p in range(P) if (p, layer) in st.valleys]
        out.append({
            "layer": layer,
            "modes_per_prompt": [int(v) for v in st.modes[:, layer]],
            "three_mode_prompts": int(three[layer]),
            "mean_sparsity": round(float(col.mean()), 6) if len(col) else None,
            "sd_sparsity": round(float(col.std()), 6) if len(col) else None,
            "within_prompt_sd": round(float(score_sd[layer]), 6),
            "lag1_autocorr": round(float(st.lag1[:, layer].mean()), 4),
            "valley_depth": round(float(depth_l[layer]), 6),
            "valleys": [round(float(v), 6) for v in np.mean(vs, axis=0)] if vs else None,
            "chosen": layer in chosen,
        })
    return out


def analyze(u: Sequence[np.ndarray], num_layers: int = DEFAULT_NUM_LAYERS,
            target_shares: dict[str, float] | None = None, min_support: float = 0.5,
            keep_per_prompt: bool = False, fallback_types: int = 1) -> Analysis:
    """Algorithm 1 on recorded sparsities: ``u[p]`` is ``[steps, layers]`` for prompt ``p``.
    ``fallback_types``: thought types ThinKV uses when no layer is tri-modal (1 or 3)."""
    shares = _check_shares(target_shares)
    used, L = _check_inputs(u, num_layers, min_support, fallback_types)
    P = len(used)
    grid = np.linspace(0.0, 1.0, GRID_POINTS)
    st = _pair_stats(used, L, grid)
    three = (st.modes == N_THOUGHT_TYPES).sum(0)
    depth_l = np.array([st.depth[st.modes[:, layer] == N_THOUGHT_TYPES, layer].mean() if three[layer]
                        else st.depth[:, layer].mean() for layer in range(L)])
    score_sd = st.sd_within.mean(0)
    intersection = [int(layer) for layer in range(L) if three[layer] == P]
    rank = sorted(range(L), key=lambda layer: (-three[layer], -depth_l[layer], -score_sd[layer], layer))
    need = max(1, math.ceil(min_support * P - 1e-9))
    k = min(num_layers, L)
    warnings: list[str] = []
    if three[rank[0]] >= need:
        rule, tshares, types = RULE_KDE, None, N_THOUGHT_TYPES
        chosen, lo, hi = _kde_rule(st, rank, three, need, num_layers, k, intersection, warnings)
    else:
        rule, tshares, types = RULE_FALLBACK, shares, fallback_types
        chosen, lo, hi = _fallback_rule(used, score_sd, shares, k, rank[0], int(three[rank[0]]), need, types,
                                        warnings)
    ub_all = pooled_u_bar(used, chosen)
    observed = classify_shares(ub_all, (lo, hi))
    kde, per_prompt = _plot_densities(used, st, ub_all, (lo, hi), grid)
    per_layer = _per_layer(used, st, three, depth_l, score_sd, chosen)
    return Analysis(rule, sorted(int(c) for c in chosen), (lo, hi), " ".join(warnings), observed, per_layer,
                    intersection, P, tshares, kde, types, per_prompt if keep_per_prompt else None)
