"""``trtkv search`` output: ``results.json`` (one record per problem + a summary), ``results.csv``,
``timelines.json`` and ``live_kv.png`` (live KV tokens over the search; drops at branch switches)."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

CSV_COLUMNS = ("problem", "correct", "answer", "expansions", "max_depth", "generated_tokens", "prompt_tokens",
               "branch_switches", "peak_cached_tokens", "peak_pages", "peak_kv_bytes", "rehydrations",
               "rehydration_s", "policy_time_share", "budget_tokens", "budget_violations", "latency_s")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(records)

    def mean(key):
        vals = [r[key] for r in records if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {"problems": n, "accuracy": sum(r["correct"] for r in records) / n if n else 0.0,
            "correct": sum(r["correct"] for r in records),
            "peak_cached_tokens_mean": mean("peak_cached_tokens"),
            "peak_cached_tokens_max": max((r["peak_cached_tokens"] for r in records), default=0),
            "peak_pages_mean": mean("peak_pages"), "peak_kv_bytes_mean": mean("peak_kv_bytes"),
            "peak_kv_bytes_max": max((r["peak_kv_bytes"] for r in records), default=0),
            "rehydrations_total": sum(r["rehydrations"] for r in records),
            "rehydration_s_total": sum(r["rehydration_s"] for r in records),
            "policy_time_share_mean": mean("policy_time_share"), "latency_s_mean": mean("latency_s"),
            "expansions_mean": mean("expansions"), "generated_tokens_mean": mean("generated_tokens"),
            "budget_violations_total": sum(r.get("budget_violations") or 0 for r in records),
            "live_pages_after_max": max((r["live_pages_after"] for r in records), default=0)}


def write_search(out: Path, doc: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    timelines = {r["problem"]: r.pop("timeline") for r in doc["records"] if "timeline" in r}
    paths = [out / "results.json", out / "results.csv", out / "timelines.json"]
    paths[0].write_text(json.dumps(doc, indent=2, default=str))
    with open(paths[1], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in doc["records"]:
            w.writerow(r)
    paths[2].write_text(json.dumps(timelines))
    try:
        paths.append(plot_timelines(timelines, out / "live_kv.png", doc.get("policy", "")))
    except ImportError:
        pass
    return paths


def plot_timelines(timelines: dict[str, list], path: Path, label: str, max_problems: int = 4) -> Path:
    from trtkv.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, points in list(timelines.items())[:max_problems]:
        xs = list(range(len(points)))
        ax.plot(xs, [p[1] for p in points], lw=1.2, label=name)
        sw = [i for i, p in enumerate(points) if p[3] == "transition"]
        ax.scatter(sw, [points[i][1] for i in sw], s=8, marker="|", color="k")
    ax.set_xlabel("search events (decode steps, transitions, boundaries, rehydrations)")
    ax.set_ylabel("live KV tokens (tree, one layer)")
    ax.set_title(f"live KV over the search — {label} (| = transition)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare_plot(docs: dict[str, dict], timelines: dict[str, dict], problem: str, path: Path) -> Path:
    """One problem's live KV under several policies (docs/benchmarks figure)."""
    from trtkv.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, tl in timelines.items():
        pts = tl.get(problem) or []
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, label=label)
    ax.set_xlabel("decode steps of the search")
    ax.set_ylabel("live KV tokens (tree, one layer)")
    ax.set_title(f"live KV over one search ({problem})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def merge_search(out: Path, dirs: list[Path]) -> list[Path]:
    """Merge the outputs of ``trtkv search --shard`` runs (same engine and settings) into one."""
    docs = [json.loads((d / "results.json").read_text()) for d in dirs]
    timelines: dict[str, list] = {}
    for d in dirs:
        timelines.update(json.loads((d / "timelines.json").read_text()))
    doc = dict(docs[0])
    doc["records"] = sorted((r for x in docs for r in x["records"]), key=lambda r: r["problem"])
    doc["summary"] = summarize(doc["records"])
    doc["wall_s"] = max(x["wall_s"] for x in docs)
    doc["merged_from"] = [str(d) for d in dirs]
    for r in doc["records"]:
        r["timeline"] = timelines.get(r["problem"], [])
    return write_search(out, doc)


if __name__ == "__main__":  # python -m trtkv.search.report OUT DIR [DIR ...]
    import sys

    print(", ".join(str(p) for p in merge_search(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])))
