"""Micro-benchmark of one paged-attention / kv_write call: compiled CPU kernel vs torch reference (and the
dense_run view path for float formats), at SmolLM2-135M geometry (3 KV heads, G=3, D=64, B=8).

    PYTHONPATH=. python build_scripts/bench_cpu_kernels.py [--ctx 128,640,2048] [--batch 1,4] [--interleaved]
Prints microseconds per call, median of repeats; ratios are within one run. ``TRTKV_PLAIN_TILES=1`` keeps
the 4-/2-bit formats on the float-tile task (docs/design.md, "CPU kernels").
"""
from __future__ import annotations

import argparse
import time

import torch

from plugins.cpu_kernels import kv_write_cpu, kv_write_groups_cpu, paged_attention_cpu
from plugins.formats import FORMATS
from plugins.kv_write.reference import kv_write_ref
from plugins.paged_attention.reference import dense_attention_cpu, paged_attention_ref

H, G, D, B = 3, 3, 64, 8


FLUSH_GROUPS = 16  # a batch of 16 requests flushing together (one group each)

def timeit(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def pool_for(fmt, pages: int):
    g = torch.Generator().manual_seed(0)
    slot = [torch.zeros((pages, B, *f.shape), dtype=f.dtype) for f in fmt.slot_fields(H, D)]
    group = [torch.zeros((pages, *f.shape), dtype=f.dtype) for f in fmt.group_fields(H, D)]
    kg = torch.full((pages, B), -1, dtype=torch.int32)
    step = fmt.group_size if fmt.quantized else B
    for i, s in enumerate(range(0, pages * B, step)):
        idx = torch.arange(s, s + step)
        k, v = torch.randn(step, H, D, generator=g), torch.randn(step, H, D, generator=g)
        kv_write_ref(k, v, slot, group, kg, idx // B, idx % B, i, fmt.code, 1.0, 1.0)
    return slot, group, kg, torch.full((pages,), (1 << B) - 1, dtype=torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="128,640,2048")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--formats", default="fp16,fp32,fp8,nvfp4,nvfp4o,ternary,int4,int2")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--interleaved", action="store_true",
                    help="each sequence's pages in 2-page runs interleaved with the batch's other sequences "
                         "(what a batch decoding in lockstep allocates), not one contiguous run")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) torch reference timings")
    a = ap.parse_args()
    print(f"threads={torch.get_num_threads()}  H={H} G={G} D={D} B={B}")
    print(f"{'format':8} {'b':>2} {'ctx':>5} {'ref us':>9} {'cpu us':>9} {'dense us':>9} {'ref/cpu':>8}")
    for name in a.formats.split(","):
        fmt = FORMATS[name]
        for b in map(int, a.batch.split(",")):
            for ctx in map(int, a.ctx.split(",")):
                P = -(-ctx // B)
                slot, group, kg, bits = pool_for(fmt, b * P)
                bt = torch.arange(b * P, dtype=torch.int32).view(b, P)
                if a.interleaved and P % 2 == 0:
                    bt = bt.view(P // 2, b, 2).permute(1, 0, 2).reshape(b, P).contiguous()
                q = torch.randn(b, H * G, D)
                args = (q, slot, group, kg, bits, bt, fmt.code, D ** -0.5, 1.0, 1.0, False)
                ref = float("nan") if a.no_ref else timeit(lambda: paged_attention_ref(*args), a.reps)
                cpu = timeit(lambda: paged_attention_cpu(*args), a.reps)
                dense = float("nan")
                if b == 1 and not fmt.quantized:
                    dense = timeit(lambda: dense_attention_cpu(q, slot, (0, ctx), D ** -0.5), a.reps)
                print(f"{name:8} {b:>2} {ctx:>5} {ref:9.1f} {cpu:9.1f} {dense:9.1f} {ref / cpu:8.2f}")
    print("kv_write, one flush group (16 tokens; 1 token for write-through formats)")
    for name in a.formats.split(","):
        fmt = FORMATS[name]
        slot, group, kg, _ = pool_for(fmt, 8)
        n = fmt.group_size
        k, v = torch.randn(n, H, D), torch.randn(n, H, D)
        pages, slots = torch.arange(n) // B, torch.arange(n) % B
        wargs = (k, v, slot, group, kg, pages, slots, 0, fmt.code, 1.0, 1.0)
        ref = float("nan") if a.no_ref else timeit(lambda: kv_write_ref(*wargs), a.reps)
        cpu = timeit(lambda: kv_write_cpu(*wargs), a.reps)
        print(f"{name:8} ref {ref:8.1f} us  cpu {cpu:8.1f} us  ref/cpu {ref / cpu:6.2f}")
    print(f"kv_write_groups, a decode step's flushes: {FLUSH_GROUPS} groups in one call, per group "
          f"(threads: {torch.get_num_threads()})")
    for name in a.formats.split(","):
        fmt = FORMATS[name]
        n = fmt.group_size
        slot, group, kg, _ = pool_for(fmt, FLUSH_GROUPS * -(-n // B))
        k, v = torch.randn(FLUSH_GROUPS, n, H, D), torch.randn(FLUSH_GROUPS, n, H, D)
        idx = torch.arange(FLUSH_GROUPS * n).view(FLUSH_GROUPS, n)
        gids = torch.arange(FLUSH_GROUPS) if fmt.quantized else torch.full((FLUSH_GROUPS,), -1)
        gargs = (k, v, slot, group, kg, idx // B, idx % B, gids, fmt.code, 1.0, 1.0)
        cpu = timeit(lambda: kv_write_groups_cpu(*gargs), a.reps) / FLUSH_GROUPS
        print(f"{name:8} cpu {cpu:8.1f} us per group")


if __name__ == "__main__":
    main()
