"""``trtkv export`` and ``--runtime onnxruntime`` end to end on the tiny random Llama (issue 17): the graphs pass
the ONNX checker, call the KV plugins as ``trtkv`` functions (or inline them), and ONNX Runtime driving them
inside trtkv's scheduler gives the PyTorch runtime's greedy tokens and, under eviction, the same kept tokens;
``export --check`` (lockstep, Polygraphy) passes for every storage format and ThinKV and catches wrong records;
bench runs both runtimes; bad input is one error line."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cli_helpers import assert_one_line_error

from trtkv.api import Engine, SamplingParams
from trtkv.runtime.observers import EngineObserver
from trtkv.runtime.scheduler import Scheduler

pytestmark = pytest.mark.model  # the tiny model uses SmolLM2's tokenizer

PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "Once upon a time, in a land far away, there lived a wise old king who loved puzzles and riddles.",
           "Numbers: 1, 2, 3"]
GREEDY = SamplingParams(max_tokens=72, ignore_eos=True, chat=False)
ENGINES = {
    "full-fp16": ("full", {"kv_format": "fp16"}),
    "thinkv": ("thinkv", {"budget": 48, "tau": 16, "group": 16, "retention": "8,4", "thought_schedule": "RTER"}),
    "streamingllm": ("streamingllm", {"budget": 20}),
    # labels from decode attention sparsity: the statistics come from the graph's attention logits
    "thinkv-sparsity": ("thinkv", {"budget": 48, "tau": 16, "group": 16, "retention": "8,4", "thresholds": "0.3,0.6",
                                   "layers": "0,1"}),
}


@pytest.fixture(scope="module")
def exported(tiny_ckpt, engine_factory, tmp_path_factory):
    """name -> (engine dir, export dir, torch Engine, onnxruntime Engine), exported once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            policy, params = ENGINES[name]
            path = engine_factory(tiny_ckpt, policy, **params)
            out = tmp_path_factory.mktemp(f"onnx-{name}")
            cache[name] = (path, out, Engine.load(path), Engine.load(path, runtime="onnxruntime", onnx_dir=out))
        return cache[name]

    return get


def run(*args):
    return subprocess.run([sys.executable, "-m", "trtkv.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_export_files_manifest_and_checker(exported):
    path, out, _, _ = exported("thinkv")
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["policy"] == "thinkv" and manifest["kv"]["formats"] == ["nvfp4", "ternary"]
    for graph in ("prefill", "decode_step"):
        f = out / f"{graph}.onnx"
        assert (out / f"{graph}.onnx.data").is_file()  # weights as external data
        onnx.checker.check_model(str(f), full_check=True)
        model = onnx.load(str(f), load_external_data=False)
        spec = manifest["graphs"][graph]
        assert [i.name for i in model.graph.input] == [s["name"] for s in spec["inputs"]]
        assert [o.name for o in model.graph.output] == [s["name"] for s in spec["outputs"]]
        called = {n.op_type for n in model.graph.node if n.domain == "trtkv"}
        defined = {fn.name for fn in model.functions if fn.domain == "trtkv"}
        assert {"KVEncode_nvfp4", "KVEncode_ternary"} <= called <= defined
        if graph == "decode_step":
            assert {"PagedAttention_nvfp4", "PagedAttention_ternary", "KVDecode_nvfp4"} <= called
            pools = [s for s in spec["inputs"] if s["name"] == "l1.nvfp4.k"][0]
            assert pools["dtype"] == "uint8" and pools["shape"][0] == "pages_l1_nvfp4"
    schemas = {f["name"]: f for f in manifest["functions"]}
    assert schemas["PagedAttention_nvfp4"]["attributes"] == ["sm_scale", "scale_k", "scale_v"]
    assert schemas["PagedAttention_nvfp4"]["inputs"][-2:] == ["valid", "block_table"]


@pytest.mark.parametrize("name", ["full-fp16", "thinkv", "thinkv-sparsity"])
def test_onnxruntime_greedy_tokens_identical(exported, name):
    _, _, torch_engine, ort_engine = exported(name)
    ref = torch_engine.generate(PROMPTS, GREEDY)
    got = ort_engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert all(len(r.token_ids) >= 64 for r in got)
    assert [r.stats["kv_bytes"] for r in got] == [r.stats["kv_bytes"] for r in ref]  # same pages held
    if name.startswith("thinkv"):
        assert [r.stats["thinkv"] for r in got] == [r.stats["thinkv"] for r in ref]  # labels, evictions, overflows
        assert all(len(r.stats["thinkv"]["labels"]) == 5 for r in got)


class _KeptTokens(EngineObserver):
    """The positions each layer attends after every step, per request."""

    def __init__(self):
        self.kept: list[list[tuple]] = []

    def on_step_end(self, reqs) -> None:
        self.kept.append([tuple(tuple(r.ctx.all_positions(layer).tolist()) for layer in range(r.ctx.num_layers))
                          for r in reqs])


def _kept(engine, prompts):
    obs = _KeptTokens()
    sched = Scheduler(engine.make_core(observers=[obs]), 8)
    reqs = [engine.make_request(p, GREEDY) for p in prompts]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    return obs.kept, [r.result.token_ids for r in reqs]


def test_streamingllm_keeps_the_same_tokens(exported):
    _, _, torch_engine, ort_engine = exported("streamingllm")
    kept_torch, tokens_torch = _kept(torch_engine, PROMPTS)
    kept_ort, tokens_ort = _kept(ort_engine, PROMPTS)
    assert tokens_ort == tokens_torch
    assert kept_ort == kept_torch
    assert all(len(layer) == 20 for step in kept_ort[-3:] for req in step for layer in req)  # evicting at budget


# --- export --check (issue 38 item 6): lockstep, every storage format ------------------------------------------
CHECK_FORMATS = ("fp32", "fp16", "bf16", "fp8", "nvfp4", "nvfp4o", "ternary", "ternaryo", "int4", "int2")
CHECK_STEPS = 48
CHECK_TOL = 1e-3  # a tenth of the command's default


def _assert_check_passed(report, steps: int = CHECK_STEPS) -> None:
    text = "\n".join(report.lines(CHECK_TOL, CHECK_TOL))
    assert report.passed and report.mismatch_count == 0, text
    assert [g.graph for g in report.graphs] == ["prefill.onnx", "decode_step.onnx"], text
    assert [g.steps for g in report.graphs] == [2, steps], text  # two prompts in one batch
    assert report.tokens == report.tokens_equal == 2 * (steps + 1), text  # greedy tokens equal at every step


@pytest.mark.parametrize("fmt", CHECK_FORMATS)
def test_export_check_passes_in_lockstep(tiny_ckpt, engine_factory, load_engine, tmp_path, fmt):
    """``export --check`` on a ``full`` engine of every storage format: each step run by ONNX Runtime and by
    PyTorch from the same cache state, logits within 1e-3, greedy tokens equal over 48 steps, and every KV record
    that differs a midpoint flip, not a mismatch (the teacher-forced replay before this failed NVFP4)."""
    from plugins.formats import get_format
    from trtkv.export.check import lockstep_check
    from trtkv.export.exporter import export_engine

    engine = load_engine(engine_factory(tiny_ckpt, "full", kv_format=fmt))
    export_engine(engine, tmp_path)
    report = lockstep_check(engine, tmp_path, steps=CHECK_STEPS, atol=CHECK_TOL, rtol=CHECK_TOL)
    _assert_check_passed(report)
    layers = engine.arch.num_hidden_layers
    if get_format(fmt).quantized:  # the prompt's full groups and at least two flushes per request and layer
        assert report.write_units >= layers * 2 * 2 + layers * 2, report.write_units
    else:  # every token of both requests, per layer
        assert report.write_units >= layers * 2 * CHECK_STEPS, report.write_units


@pytest.mark.parametrize("name", ["thinkv", "thinkv-sparsity"])
def test_export_check_passes_in_lockstep_thinkv(exported, name):
    """ThinKV (NVFP4 + ternary, evictions at the budget, anneals; thought labels from decode attention
    sparsity in the second) passes the lockstep check; the statistics the policy reads agree too."""
    from trtkv.export.check import lockstep_check

    _, out, torch_engine, _ = exported(name)
    report = lockstep_check(torch_engine, out, steps=CHECK_STEPS, atol=CHECK_TOL, rtol=CHECK_TOL)
    _assert_check_passed(report)
    if name == "thinkv-sparsity":
        assert 0 < report.stats_max_diff < 1e-4, report.stats_max_diff


def test_export_check_catches_a_wrong_record(exported, monkeypatch):
    """A graph that stores wrong codes fails the check as a real mismatch, even though both steps then attend the
    same (wrong) KV and the logits agree: the records are checked against PyTorch's encoding."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from trtkv.export.check import lockstep_check

    _, out, torch_engine, _ = exported("thinkv")
    infer = OnnxrtRunner.infer

    def corrupt(self, feed_dict, *args, **kwargs):
        got = infer(self, feed_dict, *args, **kwargs)
        for name in got:
            if name.endswith(".write.k"):
                got[name] = got[name] ^ np.uint8(0x11)  # one code of every nibble pair
        return got

    monkeypatch.setattr(OnnxrtRunner, "infer", corrupt)
    report = lockstep_check(torch_engine, out, steps=20, atol=CHECK_TOL, rtol=CHECK_TOL)
    assert not report.passed and report.mismatch_count > 0
    assert all("differ from PyTorch's encoding of the graph's own K/V" in m for m in report.mismatches), \
        report.mismatches


@pytest.mark.parametrize("fmt", CHECK_FORMATS)
def test_midpoint_flip_is_told_from_a_mismatch(fmt):
    """``compare_unit``: inputs one float apart on either side of a rounding boundary (found by bisection) give
    different records and count as a midpoint flip; the same records from inputs far apart, or other records
    from the same input, are mismatches."""
    import torch

    from plugins.formats import get_format
    from trtkv.export.check import compare_unit
    from trtkv.export.layout import to_boundary
    from trtkv.export.torch_ops import kv_encode

    g, H, D = get_format(fmt).group_size, 2, 32
    torch.manual_seed(3)
    k, v = torch.randn(1, g, H, D) * 2, torch.randn(1, g, H, D)
    live = torch.ones(1, g, dtype=torch.bool)
    scales = (0.05, 0.03)
    at = (0, g - 1, 1, 5)

    def with_value(x):
        kk = k.clone()
        kk[at] = x
        return kk, [to_boundary(t) for t in kv_encode(fmt, kk, v, live, *scales)]

    jump = 4 * float(k.abs().max())  # past any code boundary: the element becomes its channel's largest
    lo, hi = float(k[at]), float(k[at]) + jump
    base = with_value(lo)[1]
    same = lambda recs: all(np.array_equal(a, b) for a, b in zip(recs, base))  # noqa: E731
    assert not same(with_value(hi)[1])
    while True:
        mid = float(np.float32((lo + hi) / 2))
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if same(with_value(mid)[1]) else (lo, mid)
    (kt, _), (ko, theirs) = with_value(lo), with_value(hi)
    flip = compare_unit(fmt, kt, v, ko, v, live, theirs, scales)
    assert flip.mismatch is None and flip.input_diff < 1e-6, flip
    assert flip.codes + flip.scales == (0 if fmt == "fp32" else 1) or (fmt != "fp32" and flip.scales), flip
    assert compare_unit(fmt, kt, v, kt, v, live, base, scales).codes == 0  # equal records: nothing
    far, far_records = with_value(float(k[at]) + jump)
    assert "more than float rounding" in compare_unit(fmt, k, v, far, v, live, far_records, scales).mismatch
    wrong = [r.copy() for r in theirs]
    wrong[0].reshape(-1).view(np.uint8)[0] ^= 1
    assert "differ from PyTorch's encoding" in compare_unit(fmt, kt, v, ko, v, live, wrong, scales).mismatch


def test_inline_and_cli(exported, tmp_path):
    path, out, _, _ = exported("full-fp16")
    p = run("export", path, "--out", tmp_path / "inl", "--inline")
    assert p.returncode == 0, p.stderr
    model = onnx.load(str(tmp_path / "inl" / "decode_step.onnx"), load_external_data=False)
    assert not model.functions and all(n.domain != "trtkv" for n in model.graph.node)
    onnx.checker.check_model(str(tmp_path / "inl" / "prefill.onnx"), full_check=True)
    ids = np.array([1, 504, 325, 12, 9], np.int64)  # within the tiny vocabulary (1,024)
    logits = [ort.InferenceSession(str(d / "prefill.onnx")).run(["logits"], {"input_ids": ids})[0]
              for d in (out, tmp_path / "inl")]
    assert np.allclose(logits[0], logits[1], atol=1e-5)
    g = run("generate", path, "--prompt", "Hello", "--raw", "--max-tokens", "8", "--runtime", "onnxruntime",
            "--onnx-dir", out, "--json")
    assert g.returncode == 0, g.stderr
    assert len(json.loads(g.stdout)["token_ids"]) == 8


def test_bench_runs_both_runtimes(exported, tmp_path):
    from trtkv.bench import BenchConfig, load_engines, run_bench

    path, out, _, _ = exported("streamingllm")
    (path / "onnx").symlink_to(out)  # the default export location of the engine
    engines = load_engines([path], runtimes=("torch", "onnxruntime"))
    doc = run_bench(engines, BenchConfig(batch_sizes=(2,), prompt_len=24, gen_len=12, warmup=False).validate())
    rows = {r["engine"]: r for r in doc["results"]}
    assert set(rows) == {f"{path.name}@torch", f"{path.name}@onnxruntime"}
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert rows[f"{path.name}@onnxruntime"]["kv_bytes_per_request_end"] == rows[f"{path.name}@torch"][
        "kv_bytes_per_request_end"]


def test_unexportable_policy_and_bad_options_are_one_line_errors(tiny_ckpt, engine_factory, tmp_path):
    h2o = engine_factory(tiny_ckpt, "h2o", budget=48)
    assert_one_line_error(run("export", h2o, "--out", tmp_path / "x"), "cannot run from the ONNX graphs")
    assert_one_line_error(run("generate", h2o, "--prompt", "hi", "--runtime", "onnxruntime"),
                          "cannot run from the ONNX graphs")
    full = engine_factory(tiny_ckpt, "full", kv_format="fp16")
    assert_one_line_error(run("export", full, "--out", tmp_path / "y", "--opset", "12"), "--opset 12")
    tiered = engine_factory(tiny_ckpt, "full", kv_format="fp16", demote="host")
    assert_one_line_error(run("export", tiered, "--out", tmp_path / "z"), "use demote=none")


def test_missing_onnx_extra_is_one_line_error(tiny_ckpt, engine_factory, tmp_path):
    """With onnxruntime unimportable (a meta-path blocker), export and --runtime onnxruntime say what to install."""
    full = engine_factory(tiny_ckpt, "full", kv_format="fp16")
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'onnxruntime': raise ModuleNotFoundError(name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "from trtkv.cli import main; main()\n")
    for args in (["export", full, "--out", tmp_path / "x"],
                 ["generate", full, "--prompt", "hi", "--runtime", "onnxruntime"]):
        p = subprocess.run([sys.executable, "-c", blocker, *map(str, args)], capture_output=True, text=True,
                           timeout=300)
        assert_one_line_error(p, "pip install 'trtkv[onnx]'")
