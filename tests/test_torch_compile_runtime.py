"""``--runtime torch-compile`` (issue 14): the decoder's dense layer pieces through ``torch.compile``; the cache,
attention and policies as in the ``torch`` runtime. The compiled pieces compute what the eager ones do (to
float rounding), an engine generates and is benchmarked under it, and a failed compilation is one error line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dense_pieces import assert_pieces_match

from trtkv.api import Engine, SamplingParams
from trtkv.errors import TrtkvError
from trtkv.models.compiled import CompiledDecoder, _run

pytestmark = pytest.mark.model  # the tiny model uses SmolLM2's tokenizer


@pytest.fixture(scope="module")
def engines(tiny_ckpt, engine_factory):
    path = engine_factory(tiny_ckpt, "thinkv", budget=48, tau=16, group=16, retention="8,4", thought_schedule="RTER")
    return path, Engine.load(path, runtime="torch-compile")


def test_compiled_pieces_match_eager(engines):
    compiled = engines[1]
    model, dense = compiled.model, compiled.core.model
    assert isinstance(dense, CompiledDecoder) and dense._model is model  # the eager model's weights, not a copy
    assert_pieces_match(model, dense, rows=(1, 5))  # a decode step and a prompt chunk (no stale specialization)


def test_generate_and_bench_under_both_runtimes(engines, tmp_path):
    from trtkv.bench import BenchConfig, load_engines, run_bench

    path, compiled = engines
    params = SamplingParams(max_tokens=40, ignore_eos=True, chat=False)  # ThinKV anneals and evicts in this run
    r = compiled.generate(["The quick brown fox jumps over the lazy dog."] * 2, params)
    assert [len(x.token_ids) for x in r] == [40, 40] and r[0].stats["evicted_tokens"] > 0
    loaded = load_engines([path], runtimes=("torch", "torch-compile"))
    doc = run_bench(loaded, BenchConfig(batch_sizes=(2,), prompt_len=16, gen_len=8, warmup=False).validate())
    rows = {r["engine"]: r for r in doc["results"]}
    assert set(rows) == {f"{path.name}@torch", f"{path.name}@torch-compile"}
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())


def test_cli_generate_and_bad_runtime(engines):
    path = engines[0]
    run = [sys.executable, "-m", "trtkv.cli"]
    g = subprocess.run([*run, "generate", str(path), "--prompt", "Hello", "--raw", "--max-tokens", "6", "--runtime",
                        "torch-compile", "--json"], capture_output=True, text=True, timeout=600)
    assert g.returncode == 0, g.stderr
    assert len(json.loads(g.stdout)["token_ids"]) == 6
    b = subprocess.run([*run, "bench", str(path), "--runtime", "torch,compiled"], capture_output=True, text=True,
                       timeout=600)
    lines = [line for line in b.stderr.strip().splitlines() if line.strip()]
    assert b.returncode == 2 and len(lines) == 1 and "torch-compile" in lines[0], b.stderr


def test_failed_compilation_is_one_error_line():
    def broken(*_):
        raise torch._dynamo.exc.TorchDynamoException("C++ compiler not found\nlong inductor traceback ...")

    with pytest.raises(TrtkvError, match=r"^torch.compile failed \(C\+\+ compiler not found\); run with --runtime torch$"):
        _run(broken, torch.zeros(1))
