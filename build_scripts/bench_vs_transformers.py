"""Decode speed of a trtkv engine vs transformers' generate on the same weights, side by side in one run.

Usage: python build_scripts/bench_vs_transformers.py ENGINE [--tokens 128] [--repeat 3]
Batch 1, greedy, fp32 on CPU. Prints tokens/s for both and their ratio (trtkv / transformers).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from trtkv.api import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt", default="Write a long story about a cat who learns to count.")
    a = ap.parse_args()
    eng = Engine.load(a.engine)
    hf = AutoModelForCausalLM.from_pretrained(f"{a.engine}/weights", dtype=torch.float32).eval()
    ids = torch.tensor([eng.encode_prompt(a.prompt, True)])
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    ours, theirs = [], []
    eng.generate(a.prompt, SamplingParams(max_tokens=8))  # warm-up both
    hf.generate(ids, max_new_tokens=8, do_sample=False)
    for _ in range(a.repeat):  # interleaved so both see the same machine state
        t = time.perf_counter()
        r = eng.generate(a.prompt, params)[0]
        ours.append(len(r.token_ids) / (time.perf_counter() - t))
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
        theirs.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t))
    o, h = statistics.median(ours), statistics.median(theirs)
    print(f"prompt tokens {ids.shape[1]}, new tokens {a.tokens}, repeats {a.repeat}, threads {torch.get_num_threads()}")
    print(f"trtkv        {o:8.2f} tok/s  (runs: {', '.join(f'{x:.2f}' for x in ours)})")
    print(f"transformers {h:8.2f} tok/s  (runs: {', '.join(f'{x:.2f}' for x in theirs)})")
    print(f"ratio trtkv/transformers: {o / h:.2f}x")


if __name__ == "__main__":
    main()
