"""Per-step scoring cost of `trtkv eval --task fidelity`: the old path (every engine recomputes the
reference's log-softmax inside kl_divergence, plus a third log-softmax for its NLL) vs the shared-reference
path (trtkv.eval.run.compare_to_reference). Logits of SmolLM2's vocabulary, 12 engines, 4 traces per step.
Usage: python build_scripts/bench_fidelity_scoring.py [REPEATS]"""
import sys
import time

import torch

from trtkv.eval.fidelity import kl_divergence, top1_agreement
from trtkv.eval.run import compare_to_reference

V, ENGINES, B = 49152, 12, 4
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
g = torch.Generator().manual_seed(0)
ref = torch.randn(B, V, generator=g) * 3
engs = [ref + 0.3 * torch.randn(B, V, generator=g) for _ in range(ENGINES)]
tgt = torch.randint(0, V, (B, 1), generator=g)


def old():
    for lg in engs:
        lp = torch.log_softmax(lg.float(), -1)
        lp.gather(-1, tgt)
        kl_divergence(ref, lg), top1_agreement(ref, lg)


def new():
    lr = torch.log_softmax(ref.float(), -1)
    p, top = lr.exp(), lr.argmax(-1)
    for lg in engs:
        lp = torch.log_softmax(lg.float(), -1)
        lp.gather(-1, tgt)
        compare_to_reference(lr, p, top, lp)


for rep in range(reps):
    t = {}
    for name, fn in (("old", old), ("new", new)):
        t0 = time.perf_counter()
        fn()
        t[name] = time.perf_counter() - t0
    print(f"rep {rep}: old {t['old'] * 1e3:.1f} ms/step, new {t['new'] * 1e3:.1f} ms/step, "
          f"ratio {t['old'] / t['new']:.2f}x")
