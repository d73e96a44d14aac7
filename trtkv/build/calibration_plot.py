"""The calibration evidence as one PNG: per-layer sparsity densities (one small panel per layer; chosen
layers framed and tinted), the thresholds as vertical lines in every panel, and a bottom panel with the
density of ū (the mean over the chosen layers, what decode thresholds) split into E / R / T bands.

Works from the artifact alone (it stores each layer's prompt-averaged KDE on a window around the data);
per-prompt KDEs, when given, are drawn as faint lines behind the average.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

COLORS = {"E": "#4C9F70", "R": "#3B6FB6", "T": "#D1495B"}
CHOSEN = "#E07B00"
MAX_PROMPT_CURVES = 24


def plot_calibration(art: dict[str, Any], path: str | Path, per_prompt_kde: np.ndarray | None = None,
                     ncols: int | None = None) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kde = art["kde"]
    xs = np.asarray(kde["x"], dtype=np.float64)
    dens = [np.asarray(d, dtype=np.float64) for d in kde["layers"]]
    L = len(dens)
    chosen = set(art["layers"])
    lo, hi = art["thresholds"]
    per_layer = {d["layer"]: d for d in art.get("per_layer", [])}
    P = art.get("n_prompts_used") or art.get("n_prompts")

    ncols = ncols or min(6, max(1, L))
    nrows = math.ceil(L / ncols)
    fig = Figure(figsize=(2.3 * ncols, 1.35 * nrows + 3.4), dpi=110)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(nrows + 1, ncols, height_ratios=[1] * nrows + [2.2], hspace=0.6, wspace=0.12)
    for layer in range(L):
        ax = fig.add_subplot(gs[layer // ncols, layer % ncols])
        if per_prompt_kde is not None and layer < per_prompt_kde.shape[1]:
            for p in range(min(MAX_PROMPT_CURVES, per_prompt_kde.shape[0])):
                ax.plot(xs, per_prompt_kde[p, layer], color="0.55", lw=0.4, alpha=0.45)
        on = layer in chosen
        ax.plot(xs, dens[layer], color=CHOSEN if on else "k", lw=1.6 if on else 1.0)
        ax.fill_between(xs, dens[layer], color=CHOSEN if on else "0.6", alpha=0.25 if on else 0.12)
        for t in (lo, hi):
            ax.axvline(t, color="0.25", ls="--", lw=0.7)
        d = per_layer.get(layer, {})
        ax.set_title(f"L{layer}  3-mode {d.get('three_mode_prompts', '?')}/{P}", fontsize=7.5,
                     color=CHOSEN if on else "k", fontweight="bold" if on else "normal", pad=2)
        ax.set_xlim(xs[0], xs[-1])
        ax.set_yticks([])
        ax.tick_params(labelsize=6, length=2, pad=1)
        if layer // ncols != nrows - 1 and layer + ncols < L:
            ax.set_xticklabels([])
        if on:
            ax.set_facecolor("#FFF4E5")
            for s in ax.spines.values():
                s.set_edgecolor(CHOSEN)
                s.set_linewidth(2.0)

    ax = fig.add_subplot(gs[nrows, :])
    ub = np.asarray(kde["u_bar"], dtype=np.float64)
    shares = art.get("observed_shares") or {}
    for name, (a, b) in {"E": (xs[0], lo), "R": (lo, hi), "T": (hi, xs[-1])}.items():
        m = (xs >= a) & (xs <= b)
        ax.fill_between(xs[m], ub[m], color=COLORS[name], alpha=0.35,
                        label=f"{name}  {100 * shares.get(name, 0):.1f}% of steps")
    ax.plot(xs, ub, color="k", lw=1.3)
    for t, nm in ((lo, "θ_low"), (hi, "θ_high")):
        ax.axvline(t, color="0.15", ls="--", lw=1.0)
        ax.text(t, ax.get_ylim()[1] * 0.96, f" {nm}={t:.4f}", fontsize=8, va="top")
    ax.set_xlim(xs[0], xs[-1])
    ax.set_yticks([])
    ax.set_xlabel(f"ū = mean sparsity over chosen layers {sorted(chosen)} (fraction of keys < 1% of row max)",
                  fontsize=8.5)
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    ax.tick_params(labelsize=7.5)

    types = art.get("thought_types", 3)
    title = (f"ThinKV calibration — {art.get('model')}   rule: {art['rule']}   layers {sorted(chosen)}   "
             f"thresholds [{lo:.4f}, {hi:.4f}]   {types} thought type{'s' if types > 1 else ''}\n"
             f"{P} prompts × ≤{art.get('max_tokens')} tokens, stride "
             f"{art.get('step_stride')}, min_keys {art.get('min_keys')}; panels: per-layer KDE of per-step "
             f"sparsity (mean over prompts; grey: single prompts), dashed: thresholds")
    fig.suptitle(title, fontsize=9, y=0.995)
    if art.get("warning"):
        fig.text(0.5, 0.005, "\n".join(textwrap.wrap("WARNING: " + art["warning"], 150)), ha="center", va="bottom",
                 fontsize=8, color="#B00020", fontweight="bold")
    fig.subplots_adjust(top=1 - 0.55 / fig.get_figheight(), bottom=(0.75 if art.get("warning") else 0.45)
                        / fig.get_figheight() + 0.03, left=0.03, right=0.99)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


__all__ = ["plot_calibration"]
