"""Does ``torch.compile`` speed up trtkv's decode step on CPU? The dense part of one decode step (embedding,
every layer's q/k/v projection with RoPE, o_proj + MLP, logits) of an engine's own model, eager against
``torch.compile`` (inductor), interleaved in one process so a shared machine's drift hits both alike.

Usage: python build_scripts/bench_torch_compile.py ENGINE [--batch 1,16] [--repeat 12] [--mode default]
Attention is left out (each layer's query stands in for its output; shapes match): it is the paged kernel,
an opaque custom op to inductor, so compiling could only fuse what surrounds it. Prints the median ms per
step for both and their ratio per batch size, and checks that both compute the same logits.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo

from trtkv.api import Engine


def dense_step(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The decode step's dense layers (``EngineCore.decode_step`` without the cache and attention)."""
    cos, sin = model.rotary.cos_sin(positions, torch.float32)
    x = model.embed(ids)
    for layer in range(model.arch.num_hidden_layers):
        q, _, _ = model.qkv(layer, x, cos, sin)
        x = model.finish_layer(layer, x, q)
    return model.logits(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--repeat", type=int, default=12)
    ap.add_argument("--mode", default="default", help="torch.compile mode (default, max-autotune, ...)")
    a = ap.parse_args()
    model = Engine.load(a.engine).model
    torch._dynamo.config.cache_size_limit = 64
    compiled = torch.compile(lambda ids, pos: dense_step(model, ids, pos), dynamic=False,
                             mode=None if a.mode == "default" else a.mode)
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, mode {a.mode}")
    with torch.inference_mode():
        for b in (int(x) for x in a.batch.split(",")):
            ids, pos = torch.randint(0, model.arch.vocab_size, (b,)), torch.arange(100, 100 + b)
            t = time.perf_counter()
            ref, got = dense_step(model, ids, pos), compiled(ids, pos)
            compile_s = time.perf_counter() - t
            err = (ref - got).abs().max().item()
            times = {"eager": [], "compiled": []}
            runs = (("eager", lambda: dense_step(model, ids, pos)), ("compiled", lambda: compiled(ids, pos)))
            for _ in range(a.repeat):
                for name, fn in runs:
                    t = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t) * 1e3)
            e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
            print(f"batch {b:3d}: eager {e:7.2f} ms, compiled {c:7.2f} ms, eager/compiled {e / c:.2f}x "
                  f"(first call incl. compile {compile_s:.1f} s; max |logit diff| {err:.2e})")


if __name__ == "__main__":
    main()
