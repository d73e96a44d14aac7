"""Decode tokens/s of engines under the torch reference kernels vs the compiled CPU kernels, side by side in
one process: for every repeat and batch size, each engine runs once per kernel mode (``TRTKV_KERNELS`` is
read at every plugin call), interleaved so machine noise hits both alike.

    PYTHONPATH=. python build_scripts/bench_kernels_side_by_side.py ENGINE... [--batch-sizes 1,4]
        [--prompt-len 128] [--gen-len 512] [--repeat 2] [--modes reference,cpu]

Prints a markdown table: decode tokens/s (generated tokens of decode steps / decode time) per
(engine, kernel mode, batch), its ratio to the first engine under the same mode, and the cpu/reference
speedup per engine.
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from trtkv.bench.runner import BenchConfig, load_engines, machine_info, parse_batch_sizes, run_once


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", default="reference,cpu")
    a = ap.parse_args()
    cfg = BenchConfig(batch_sizes=parse_batch_sizes(a.batch_sizes), prompt_len=a.prompt_len, gen_len=a.gen_len,
                      repeat=a.repeat).validate()
    modes = a.modes.split(",")
    engines = load_engines(a.engines)
    print(f"machine: {machine_info()}  threads={torch.get_num_threads()}")
    tps: dict[tuple[str, str, int], list[float]] = {}
    for be in engines:  # warm-up: first-use builds, allocator, caches
        for m in modes:
            os.environ["TRTKV_KERNELS"] = m
            run_once(be, 1, BenchConfig(prompt_len=16, gen_len=8), 0)
    for rep in range(cfg.repeat):
        for b in cfg.batch_sizes:
            for be in engines:
                for m in (modes if rep % 2 == 0 else modes[::-1]):
                    os.environ["TRTKV_KERNELS"] = m
                    r = run_once(be, b, cfg, rep)
                    tps.setdefault((be.label, m, b), []).append(sum(r.step_batch) / sum(r.decode_s))
                    print(f"  rep {rep} b={b} {be.label:22} {m:9} {tps[(be.label, m, b)][-1]:7.1f} tok/s", flush=True)
    os.environ.pop("TRTKV_KERNELS", None)
    base = engines[0].label
    print("\n| engine | batch | " + " | ".join(f"{m} tok/s | {m} x {base}" for m in modes)
          + " | " + " / ".join(modes[::-1]) + " |")
    print("|---|---:|" + "---:|---:|" * len(modes) + "---:|")
    for b in cfg.batch_sizes:
        for be in engines:
            med = {m: statistics.median(tps[(be.label, m, b)]) for m in modes}
            cells = [f"{med[m]:.1f} | {med[m] / statistics.median(tps[(base, m, b)]):.2f}" for m in modes]
            print(f"| {be.label} | {b} | " + " | ".join(cells) + f" | {med[modes[-1]] / med[modes[0]]:.2f} |")


if __name__ == "__main__":
    main()
