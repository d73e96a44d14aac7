"""Compile every Triton kernel specialization for sm_80/90/100 and print the resource table (markdown).

    PYTHONPATH=. python build_scripts/triton_aot_report.py [--targets 80,90,100] [--workers N]

No GPU needed (plugins/triton_aot.py). Exit status 1 if a kernel fails to compile or spills. ``--opt-in`` adds
the ``TRTKV_TRITON_PRECISION=tf32`` attention variants.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import triton

from plugins.triton_aot import all_specs, compile_all, report_markdown
from trtkv.models.registry import load_registry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="80,90,100")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--opt-in", action="store_true", help="also the opt-in TF32 attention variants")
    ap.add_argument("--reuse-cache", action="store_true",
                    help="reuse Triton's compile cache (the timing then means nothing)")
    a = ap.parse_args()
    targets = tuple(int(t) for t in a.targets.split(","))
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        archs = [spec.arch for spec in load_registry().values() if spec.config]
        usages = compile_all(all_specs(archs, a.opt_in), targets=targets, workers=a.workers,
                             cache_dir=None if a.reuse_cache else tmp)
    print(f"Triton {triton.__version__}, targets {', '.join(f'sm_{t}' for t in targets)}, "
          f"{len(usages)} compiles in {time.time() - t0:.0f} s\n")
    print(report_markdown(usages))
    return 1 if any(u.error or u.spills for u in usages) else 0


if __name__ == "__main__":
    sys.exit(main())
