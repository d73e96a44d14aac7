"""Per-step cost of incremental vs full detokenization over a 2,048-token output (docs/benchmarks.md).

Usage: python build_scripts/bench_detokenize.py [TRACES_JSONL]
"""
import json
import statistics
import sys
import time

from trtkv.models.config import ModelArch
from trtkv.models.fetch import fetch
from trtkv.models.registry import resolve_model
from trtkv.runtime.request import IncrementalDetokenizer
from trtkv.tokenizer import load_tokenizer

path = sys.argv[1] if len(sys.argv) > 1 else "../shared/data/r1distill_traces_thought_anchors.jsonl"
ck = fetch(resolve_model("smollm2-135m"), quiet=True)
tok = load_tokenizer(ck, ModelArch.from_hf_config(json.loads((ck / "config.json").read_text())))
ids = tok.encode(open(path).read()[:40000])[:2048]


def run(step):
    t = []
    for n in range(1, len(ids) + 1):
        t0 = time.perf_counter()
        step(ids[:n])
        t.append(time.perf_counter() - t0)
    return statistics.median(t[:256]) * 1e6, statistics.median(t[-256:]) * 1e6


inc = run(IncrementalDetokenizer(tok.decode).push)
print("incremental: first 256 steps %.1f us/step, last 256 steps %.1f us/step" % inc)
print("full re-decode (before): first %.1f us/step, last %.1f us/step" % run(tok.decode))
