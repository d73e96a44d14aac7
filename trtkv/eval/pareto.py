"""The Pareto frontier of a fidelity run: which engines no other engine beats on both memory and fidelity.

An engine is *on the frontier* when no engine in the same run holds fewer (or equal) KV bytes per token
and is at least as faithful, strictly better in one of the two. Two views: top-1 agreement (higher is
better) and mean KL (lower is better), both against the mean KV bytes held per token. The reference
(the full cache itself) takes part: it is the most faithful point by definition.
"""
from __future__ import annotations

from typing import Any

BYTES_KEY = "kv_bytes_per_token_mean"
VIEWS = {"top1": ("top1_agreement", True), "kl": ("mean_kl", False)}  # metric, higher is better


def frontier(points: list[tuple[str, float, float]], higher_is_better: bool = True) -> list[str]:
    """Names of the non-dominated ``(name, bytes, metric)`` points, in increasing bytes."""
    sign = 1.0 if higher_is_better else -1.0
    out = []
    for name, x, y in points:
        dominated = any((x2 <= x and sign * y2 >= sign * y) and (x2 < x or sign * y2 > sign * y)
                        for n2, x2, y2 in points if n2 != name)
        if not dominated:
            out.append((x, name))
    return [n for _, n in sorted(out)]


def mark_frontier(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Set ``on_frontier_top1`` / ``on_frontier_kl`` on every record that has the numbers; returns the
    frontiers by view, each in increasing bytes."""
    fronts = {}
    for view, (key, higher) in VIEWS.items():
        pts = [(r["engine"], r[BYTES_KEY], r[key]) for r in records
               if r.get(BYTES_KEY) is not None and r.get(key) is not None]
        fronts[view] = frontier(pts, higher)
        for r in records:
            r[f"on_frontier_{view}"] = r["engine"] in fronts[view] if r.get(key) is not None else None
    return fronts
