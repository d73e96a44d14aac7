"""PNG plots of ``trtkv eval`` results: fidelity and accuracy against KV memory, the Pareto frontier."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trtkv.plotting import MiB, pyplot, save


def fidelity_plot(records: list[dict[str, Any]], out: Path) -> Path:
    """KL and top-1 agreement against KV memory (fraction of an fp16 full cache), one point per engine."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in records:
        x = r.get("kv_fraction_fp16_mean")
        if x is None:
            continue
        for ax, key in ((a1, "mean_kl"), (a2, "top1_agreement")):
            if r.get(key) is None:
                continue
            ax.scatter([x], [r[key]], s=36)
            ax.annotate(r["engine"], (x, r[key]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    a1.set_ylabel("mean KL(full ‖ engine) per token (nats)")
    a2.set_ylabel("top-1 next-token agreement with full")
    for ax in (a1, a2):
        ax.set_xlabel("KV bytes held / uncompressed fp16 (mean over steps)")
        ax.grid(alpha=0.3)
    synth = any(r.get("synthetic_weights") for r in records)
    fig.suptitle("Fidelity vs KV memory (teacher-forced traces)" + (" — synthetic weights" if synth else ""))
    fig.tight_layout()
    return save(fig, out / "fidelity_vs_kv.png", plt)


PARETO_LABEL_ALL_MAX = 16  # engines in a run up to which every point is named; above, the frontier and ThinKV's


def pareto_plot(records: list[dict[str, Any]], out: Path) -> Path:
    """Top-1 agreement and KL against KV bytes per token (log scale), every engine a point coloured by its
    policy, the frontier drawn as a step line and its engines filled (``trtkv.eval.pareto``); one PNG, two
    panels. A large grid names only the frontier's engines and ThinKV's, so the labels stay readable."""
    from matplotlib.lines import Line2D

    from trtkv.eval.pareto import BYTES_KEY, VIEWS, frontier

    plt = pyplot()
    many = len(records) > PARETO_LABEL_ALL_MAX
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5) if many else (12, 4.8))
    policy = {r["engine"]: str(r.get("policy")) for r in records}
    colour = {p: f"C{i % 10}" for i, p in enumerate(sorted(set(policy.values())))}
    for ax, (view, (key, higher)) in zip(axes, VIEWS.items()):
        pts = [(r["engine"], r[BYTES_KEY], r[key]) for r in records
               if r.get(BYTES_KEY) is not None and r.get(key) is not None]
        front = frontier(pts, higher)
        on = set(front)
        for name, x, y in pts:
            c = colour[policy[name]]
            ax.scatter([x], [y], s=40, marker="o", facecolors=c if name in on else "none", edgecolors=c, zorder=3)
            if not many or name in on or policy[name].startswith("thinkv"):
                ax.annotate(name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points",
                            fontweight="bold" if name in on else "normal")
        by = {n: (x, y) for n, x, y in pts}
        fx, fy = [by[n][0] for n in front], [by[n][1] for n in front]
        handles = [Line2D([], [], marker="o", ls="", color=c, label=p) for p, c in colour.items()]
        if fx:
            ax.step(fx, fy, where="post", color="0.4", alpha=0.6)
            handles.append(Line2D([], [], color="0.4", label="Pareto frontier (filled: on it)"))
        ax.legend(handles=handles, fontsize=7, loc="lower right" if higher else "upper right")
        ax.set_xscale("log")
        xs = [x for _, x, _ in pts if x > 0]
        if xs:  # plain byte counts at 1-2-5 steps instead of powers of ten
            lo, hi = min(xs) / 1.5, max(xs) * 1.5
            ticks = [m * 10 ** e for e in range(0, 9) for m in (1, 2, 5) if lo <= m * 10 ** e <= hi]
            ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("KV bytes held per token (mean over steps, all layers; log scale)")
        ax.set_ylabel("top-1 next-token agreement with full" if view == "top1" else "mean KL(full ‖ engine), nats")
        if not higher and any(y > 0 for *_, y in pts):
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
    synth = any(r.get("synthetic_weights") for r in records)
    r0 = next((r for r in records if r.get("tokens")), {})
    fig.suptitle(f"Fidelity vs KV bytes per token — {r0.get('traces')} trace(s), {r0.get('tokens')} forced tokens; "
                 "filled: on the frontier" + ("; named: the frontier and ThinKV" if many else "")
                 + (" — synthetic weights" if synth else ""), fontsize=10)
    fig.tight_layout()
    return save(fig, out / "pareto.png", plt)


def accuracy_plot(records: list[dict[str, Any]], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in records:
        x = r.get("peak_kv_bytes_mean")
        if x is None:
            continue
        ax.scatter([x / MiB], [r["pass@1"]], s=36)
        ax.annotate(r["engine"], (x / MiB, r["pass@1"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("mean per-request peak KV bytes (MiB)")
    ax.set_ylabel("pass@1")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    task = records[0]["task"] if records else ""
    ax.set_title(f"{task}: accuracy vs KV memory", fontsize=10)
    fig.tight_layout()
    return save(fig, out / f"accuracy_vs_kv_{task}.png", plt)
