"""The cache's own work in a decode step, without a model: every layer's write-through slots for a batch
(``plan_write_through``), each layer's ``kv_write`` and the batch's block tables — what a full cache's step
costs the host besides compute, at r1-llama-8b's depth by default.

    python build_scripts/bench_cache_step.py --layers 32 --batch 256 --steps 256 [--repeat 3]

Prints the mean and median milliseconds a step and the mean of the page-boundary steps (one in 8), each round
after a first untimed one (pages recycled, as a serving engine's are).
Run two trees side by side with ``PYTHONPATH=<tree>`` (the same numbers from both, the same machine)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from trtkv.cache.manager import CacheConfig, KVCacheManager


def run(cache: KVCacheManager, batch: int, steps: int, prompt: int, heads: int, dim: int, fmt: str) -> list[float]:
    """One round: ``batch`` requests written ``prompt + steps`` tokens a layer, the last ``steps`` timed; freed."""
    layers = cache.cfg.num_layers
    seqs = [cache.add_sequence(i) for i in range(batch)]
    k = torch.randn(batch, heads, dim, dtype=torch.float16)
    cls = (fmt, 0)
    times = []
    for step in range(prompt + steps):
        pos = [step] * batch
        t0 = time.perf_counter()
        plan = cache.plan_write_through(seqs, pos, cls, always=True)
        for layer in range(layers):
            cache.write_planned(plan, layer, k, k)
            cache.block_tables(layer, seqs)
        if step >= prompt:
            times.append((time.perf_counter() - t0) * 1e3)
    for s in seqs:
        cache.free_sequence(s.seq_id)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64, help="steps written before timing starts")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--format", default="fp16")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cache = KVCacheManager(CacheConfig(num_layers=a.layers, num_kv_heads=a.heads, head_dim=a.dim, max_batch=a.batch,
                                       max_pages=a.batch * (a.prompt + a.steps) // 8 + 64))
    run(cache, a.batch, a.steps, a.prompt, a.heads, a.dim, a.format)  # (untimed: the pools' pages first touched)
    for _ in range(a.repeat):
        t = run(cache, a.batch, a.steps, a.prompt, a.heads, a.dim, a.format)
        boundary = t[::8]
        print(f"mean {statistics.mean(t):.2f} ms  median {statistics.median(t):.2f} ms  "
              f"boundary steps {statistics.mean(boundary):.2f} ms")


if __name__ == "__main__":
    main()
