"""PNG plots of ``trtkv bench`` results (matplotlib, headless; ``trtkv eval``'s are in trtkv/eval/plots.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trtkv.plotting import MiB, pyplot, save


def _title(doc: dict[str, Any], what: str) -> str:
    cfg = doc.get("config", {})
    t = f"{what} — prompt {cfg.get('prompt_len')}, gen {cfg.get('gen_len')}"
    if doc.get("synthetic_weights"):
        t += " (synthetic weights)"
    return t


def _series(doc: dict[str, Any], key: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in doc["results"]:
        if r.get(key) is None:
            continue
        xs, ys = out.setdefault(r["engine"], ([], []))
        xs.append(r["batch"])
        ys.append(r[key])
    return out


def _batch_axis(ax, doc: dict[str, Any]) -> None:
    sizes = sorted({r["batch"] for r in doc["results"]})
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(s) for s in sizes])
    ax.set_xlabel("batch size (concurrent requests)")
    ax.grid(alpha=0.3)


def bench_plots(doc: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    paths = []

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, (xs, ys) in _series(doc, "tpot_ms_p50").items():
        p90 = [r["tpot_ms_p90"] for r in doc["results"] if r["engine"] == name and r["tpot_ms_p50"] is not None]
        line, = a1.plot(xs, ys, marker="o", label=f"{name} p50")
        a1.plot(xs, p90, marker=".", ls="--", color=line.get_color(), alpha=0.6, label=f"{name} p90")
    a1.set_ylabel("time per output token (ms)")
    a1.set_title("decode step latency")
    for name, (xs, ys) in _series(doc, "e2e_s").items():
        a2.plot(xs, ys, marker="o", label=name)
    a2.set_ylabel("end-to-end latency of the batch (s)")
    a2.set_title("end-to-end latency")
    for ax in (a1, a2):
        _batch_axis(ax, doc)
        ax.legend(fontsize=8)
    fig.suptitle(_title(doc, "Latency vs batch"))
    fig.tight_layout()
    paths.append(save(fig, out / "latency_vs_batch.png", plt))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, (xs, ys) in _series(doc, "tokens_per_s").items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_ylabel("output tokens/s (whole batch)")
    _batch_axis(ax, doc)
    ax.legend(fontsize=8)
    ax.set_title(_title(doc, "Throughput vs batch"), fontsize=10)
    fig.tight_layout()
    paths.append(save(fig, out / "throughput_vs_batch.png", plt))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drew_full = False
    for name, tr in doc["kv_trace"].items():
        if not tr["generated_tokens"]:
            continue
        ax.plot(tr["generated_tokens"], [b / MiB for b in tr["kv_bytes"]], label=name)
        if not drew_full:
            ax.plot(tr["generated_tokens"], [b / MiB for b in tr["kv_bytes_full_fp16"]], ls="--", color="gray",
                    label="uncompressed fp16")
            drew_full = True
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV bytes held by one request (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(doc, "KV memory vs generated tokens"), fontsize=10)
    fig.tight_layout()
    paths.append(save(fig, out / "kv_vs_tokens.png", plt))
    if any(r.get("admission_batch") for r in doc["results"]):
        paths.append(memory_limited_plot(doc, out, plt))
    return paths


def memory_limited_plot(doc: dict[str, Any], out: Path, plt) -> Path:
    """The memory-limited run: decode tokens/s (batch / step time, median over the steps at each batch) against
    the concurrent batch, per engine, with each engine's steady-state tokens/s at its largest batch."""
    import statistics

    fig, ax = plt.subplots(figsize=(7, 4.4))
    for row in doc["results"]:
        by_batch: dict[int, list[float]] = {}
        for run in doc["runs"]:
            if run["engine"] == row["engine"] and run["batch"] == row["batch"]:
                for b, s in zip(run["step_batch"], run["decode_s"]):
                    if s > 0:
                        by_batch.setdefault(b, []).append(b / s)
        xs = sorted(by_batch)
        line, = ax.plot(xs, [statistics.median(by_batch[x]) for x in xs], marker=".", label=row["engine"])
        ax.plot([row["max_concurrent"]], [row["steady_tokens_per_s"]], marker="*", ms=12, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests (decode batch)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    kv = doc["config"].get("kv_memory")
    ax.set_title(_title(doc, f"Throughput at {kv / MiB:.0f} MiB of KV memory (star: steady state)"), fontsize=10)
    fig.tight_layout()
    return save(fig, out / "throughput_at_memory_limit.png", plt)
