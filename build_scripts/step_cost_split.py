"""Where a long `trtkv bench` run's decode time goes, from its per-step times (results.json ``runs``): the
steps on which the residual buffers flush (every ``--group``-th step: ``i % group == group - 1``, since every
request of the batch started flushed), the other steps, and the excess of the flush steps over the others,
spread over every step. ThinKV's anneals happen on flush steps (an anneal is decided when the buffer is about
to flush), so its flush-step excess includes them.

    python build_scripts/step_cost_split.py results/s27/long-v6/long/results.json [--group 16]
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--group", type=int, default=16, help="residual-buffer flush group (g)")
    a = ap.parse_args()
    runs = json.load(open(a.results))["runs"]
    print(f"{'engine':12} {'steps':>6} {'mean':>7} {'median':>7} {'flush steps':>12} {'others':>7} "
          f"{'excess/step':>12} {'decode s':>9}   (ms)")
    for r in runs:
        ds = np.asarray(r["decode_s"]) * 1e3
        flush = np.arange(len(ds)) % a.group == a.group - 1
        excess = (ds[flush].mean() - ds[~flush].mean()) * flush.sum() / len(ds)
        print(f"{r['engine']:12} {len(ds):6d} {ds.mean():7.1f} {np.median(ds):7.1f} {ds[flush].mean():12.1f} "
              f"{ds[~flush].mean():7.1f} {excess:12.1f} {ds.sum() / 1e3:9.1f}")


if __name__ == "__main__":
    main()
