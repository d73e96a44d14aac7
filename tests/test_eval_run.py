"""``trtkv eval``: teacher-forced fidelity with known answers, a tiny accuracy run, and bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from cli_helpers import assert_one_line_error

from trtkv.eval.datasets import PACKAGE_DATA_DIR
from trtkv.eval.run import _accuracy_summary, pick_layers

TRACES = str(PACKAGE_DATA_DIR / "traces_small.jsonl")


def test_pick_layers():
    assert pick_layers(30, "all") == tuple(range(30))
    assert pick_layers(30, 4) == (0, 10, 19, 29)
    assert pick_layers(2, 8) == (0, 1)
    assert pick_layers(30, "3,1") == (1, 3)
    assert pick_layers(30, "none") == ()


def test_shared_reference_scoring_equals_the_metric_functions():
    import torch

    from trtkv.eval.fidelity import kl_divergence, top1_agreement
    from trtkv.eval.run import compare_to_reference

    g = torch.Generator().manual_seed(0)
    ref, test = torch.randn(3, 500, generator=g) * 4, torch.randn(3, 500, generator=g) * 4
    test[1] = ref[1]  # one identical row
    lr = torch.log_softmax(ref, -1)
    kl, agree = compare_to_reference(lr, lr.exp(), lr.argmax(-1), torch.log_softmax(test, -1))
    assert torch.allclose(kl, kl_divergence(ref, test), rtol=1e-5, atol=1e-7) and kl[1] == 0
    assert torch.equal(agree, top1_agreement(ref, test))


def test_pareto_frontier():
    from trtkv.eval.pareto import frontier, mark_frontier

    pts = [("a", 10, 0.9), ("b", 20, 0.95), ("c", 20, 0.93), ("d", 5, 0.5), ("e", 30, 0.95), ("f", 10, 0.9)]
    assert frontier(pts) == ["d", "a", "f", "b"]  # c and e dominated by b; a and f tie (neither dominates)
    assert frontier([("x", 1, 0.05), ("y", 2, 0.1)], higher_is_better=False) == ["x"]
    recs = [{"engine": n, "kv_bytes_per_token_mean": x, "top1_agreement": y, "mean_kl": 1 - y} for n, x, y in pts]
    fronts = mark_frontier(recs)
    assert fronts["top1"] == fronts["kl"] == ["d", "a", "f", "b"]
    assert [r["on_frontier_top1"] for r in recs] == [True, True, False, True, False, True]


def test_accuracy_summary_counts():
    rows = [  # problem a: 2 of 3 correct, majority right; problem b: 1 of 3, majority wrong
        {"problem": "a", "answer": "5", "correct": True}, {"problem": "a", "answer": "5", "correct": True},
        {"problem": "a", "answer": "6", "correct": False}, {"problem": "b", "answer": "1", "correct": False},
        {"problem": "b", "answer": "1", "correct": False}, {"problem": "b", "answer": "7", "correct": True}]
    for r in rows:
        r.update(generated_tokens=10, finish_reason="stop", kv_bytes=50, peak_kv_bytes=60, kv_bytes_full=100,
                 tokens_per_s=1.0)
    s = _accuracy_summary(rows, 2, 3)
    assert s["pass@1"] == pytest.approx(0.5) and s["pass@3"] == 1.0 and s["accuracy"] == 0.5
    assert s["kv_fraction_fp16_mean"] == 0.5 and s["truncated_fraction"] == 0.0


@pytest.mark.model
def test_fidelity_known_answers(tiny_ckpt, engine_factory, tmp_path):
    """A full engine equals the reference exactly; a 16-token window over ~100-token prompts does not."""
    from trtkv.cli import main

    full = engine_factory(tiny_ckpt, "full")
    sl = engine_factory(tiny_ckpt, "streamingllm", budget=16)
    out = tmp_path / "fid"
    r = CliRunner().invoke(main, ["eval", str(full), str(sl), "--task", "fidelity", "--data", TRACES, "--limit", "2",
                                  "--max-tokens", "16", "--recall-layers", "all", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    ref, f, s = doc["records"]
    assert ref["is_reference"] and not f["is_reference"] and (f["policy"], s["policy"]) == ("full", "streamingllm")
    assert f["traces"] == 2 and f["tokens"] == 32 and f["n_steps"] == 32 and f["recall_layers"] == [0, 1]
    assert f["mean_kl"] == 0.0 and f["top1_agreement"] == 1.0 and f["attn_recall"] == 1.0
    assert f["nll"] == pytest.approx(ref["nll"]) and f["kv_vs_reference_mean"] == 1.0
    assert s["mean_kl"] > 1e-4 and s["attn_recall"] < 1.0 and s["top1_agreement"] <= 1.0
    assert s["kv_vs_reference_mean"] < 0.5 and s["evicted_tokens_mean"] > 0
    assert (out / "fidelity_vs_kv.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert ref["on_frontier_top1"] and s["on_frontier_top1"]  # fewest bytes / most faithful
    assert f["kv_bytes_per_token_mean"] == ref["kv_bytes_per_token_mean"] and f["on_frontier_top1"]  # a tie
    assert "mean KL" in r.output and "frontier" in r.output


@pytest.mark.model
def test_fidelity_explicit_reference(tiny_ckpt, engine_factory):
    """The same comparison against a full engine the user names, driven through the Python API."""
    from trtkv.bench.runner import load_engines
    from trtkv.eval import load_traces
    from trtkv.eval.run import run_fidelity

    full = engine_factory(tiny_ckpt, "full")
    engines = load_engines([full])
    ref = load_engines([full])[0]
    recs = run_fidelity(engines, load_traces(TRACES, 1), max_tokens=8, reference=ref, recall_layers=1,
                        progress=False)
    assert recs[-1]["mean_kl"] == 0.0 and recs[-1]["top1_agreement"] == 1.0 and recs[-1]["attn_recall"] == 1.0
    assert not engines[0].engine.core.cache.seqs and not ref.engine.core.cache.seqs  # everything freed
    assert not engines[0].engine.core.observers  # eval watched cores of its own


@pytest.mark.model
def test_accuracy_two_gsm8k_problems(tiny_ckpt, engine_factory, tmp_path):
    from trtkv.cli import main

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3+4=7\n#### 7"},
        {"question": "A box holds 12 eggs. How many eggs are in 2 boxes?", "answer": "12*2=24\n#### 24"},
        {"question": "never read", "answer": "#### 0"})))
    full = engine_factory(tiny_ckpt, "full")
    sl = engine_factory(tiny_ckpt, "streamingllm", budget=16)
    out = tmp_path / "acc"
    r = CliRunner().invoke(main, ["eval", str(full), str(sl), "--task", "gsm8k", "--data", str(data), "--limit", "2",
                                  "--max-tokens", "6", "--samples", "2", "--temperature", "0.7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    assert [x["policy"] for x in doc["records"]] == ["full", "streamingllm"]
    for rec in doc["records"]:
        assert rec["problems"] == 2 and rec["samples"] == 2
        assert 0.0 <= rec["pass@1"] <= rec["pass@2"] <= 1.0 and 0.0 <= rec["accuracy"] <= 1.0
        assert 0 < rec["mean_generated_tokens"] <= 6 and rec["peak_kv_bytes_mean"] > 0
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {x["reference"] for x in rows} == {"7", "24"}
    assert any(x["kv_bytes_shared"] > 0 for x in rows)  # a problem's K samples fork its prompt's pages
    assert (out / "accuracy_vs_kv_gsm8k.png").is_file()
    assert "pass@1" in r.output


def test_eval_bad_input(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "trtkv.cli", "eval", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    assert_one_line_error(run(str(tmp_path), "--task", "mmlu"), "'mmlu' is not one of")
    assert_one_line_error(run(str(tmp_path), "--task", "gsm8k", "--data", str(tmp_path / "none.jsonl")), "not found")
    assert_one_line_error(run(str(tmp_path / "missing"), "--task", "fidelity", "--data", TRACES), "no engine at")


def test_lockstep_decode_matches_separate_steps(tiny_ckpt, engine_factory):
    """Cores sharing one model, stepped with one dense forward, give each core's own decode_step results."""
    from trtkv.bench.runner import load_engines
    from trtkv.eval.lockstep import lockstep_decode
    from trtkv.eval.run import StepRecorder, reference_core
    from trtkv.runtime.request import Request
    from trtkv.runtime.sampling import SamplingParams, make_generator

    full, sl = engine_factory(tiny_ckpt, "full"), engine_factory(tiny_ckpt, "streamingllm", budget=16)
    a, b = load_engines([full, sl])
    assert a.engine.core.model is b.engine.core.model  # shared weights: the lockstep precondition
    forced = list(range(5, 45))

    def run(lockstep: bool):
        recs = [StepRecorder(()) for _ in range(3)]
        cores = [reference_core(a.engine, [recs[0]]), a.engine.make_core(observers=[recs[1]]),
                 b.engine.make_core(observers=[recs[2]])]
        reqs = []
        for ci, c in enumerate(cores):
            row = []
            for i in range(2):
                r = Request(-(1 + i + 2 * ci), "", list(range(3, 23 + 7 * i)),
                            SamplingParams(max_tokens=len(forced), ignore_eos=True, chat=False), make_generator(0), 512)
                r.forced_tokens = forced
                c.prefill(r)
                row.append(r)
            reqs.append(row)
        seen = []
        for _ in range(len(forced) - 1):
            if lockstep:
                lockstep_decode(cores, reqs)
            else:
                for c, row in zip(cores, reqs):
                    c.decode_step(row)
            seen.append([rec.logits.clone() for rec in recs])
        live = [r.ctx.num_live(0) for row in reqs for r in row]
        for c, row in zip(cores, reqs):
            for r in row:
                c.finish(r)
        return seen, live

    together, live_t = run(True)
    apart, live_a = run(False)
    assert live_t == live_a and max(live_t[4:]) <= 16 < min(live_t[:4])  # streamingllm evicted, full did not
    for st, sa in zip(together, apart):
        for lt, la in zip(st, sa):
            torch.testing.assert_close(lt, la, rtol=1e-4, atol=1e-4)
