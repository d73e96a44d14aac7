"""Merging fidelity runs over the same traces: one table, the frontier over all parts, mismatches refused."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from trtkv.cli import main
from trtkv.errors import TrtkvError
from trtkv.eval.merge import merge_runs, read_run


def record(engine, kv, top1, kl, ref=False):
    return {"engine": engine, "is_reference": ref, "model": "smollm2-135m", "dtype": "fp32", "traces": 4,
            "tokens": 8192, "nll": 1.324 if ref else 1.5, "kv_bytes_per_token_mean": kv, "top1_agreement": top1,
            "mean_kl": kl, "p90_kl": kl, "kv_fraction_fp16_mean": kv / 23000, "policy": "x", "topk": 10,
            "recall_layers": [], "attn_recall": None, "kv_vs_reference_mean": kv / 46000}


def run_doc(tmp_path, name, engines, **config):
    cfg = {"task": "fidelity", "limit": 4, "max_tokens": 2048, "recall_layers": "none", "topk": 10, **config}
    doc = {"kind": "trtkv-eval", "version": 1, "task": "fidelity", "command": f"trtkv eval {name}", "config": cfg,
           "records": [record("full (reference)", 46000, 1.0, 0.0, ref=True)] + [record(*e) for e in engines]}
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps(doc))
    return d


def test_merge_marks_the_frontier_over_all_parts(tmp_path):
    a = run_doc(tmp_path, "a", [("a-small", 3000, 0.80, 0.30), ("a-big", 9000, 0.85, 0.20)])
    b = run_doc(tmp_path, "b", [("b-mid", 5000, 0.90, 0.10)])  # dominates a-big, which was on a's frontier
    doc = merge_runs([read_run(a), read_run(b)])
    by = {r["engine"]: r for r in doc["records"]}
    assert len(doc["records"]) == 4 and sum(r["is_reference"] for r in doc["records"]) == 1
    assert by["a-small"]["on_frontier_top1"] and by["b-mid"]["on_frontier_top1"]
    assert not by["a-big"]["on_frontier_top1"] and not by["a-big"]["on_frontier_kl"]
    assert [p["engines"] for p in doc["merged_from"]] == [2, 1]


@pytest.mark.parametrize("change,match", [
    ({"config": {"max_tokens": 1024}}, "max_tokens"),
    ({"ref": {"tokens": 4096}}, "reference has tokens"),
    ({"ref": {"nll": 1.4}}, "NLL differ"),
    ({"dup": True}, "is in both"),
])
def test_merge_refuses_runs_that_do_not_match(tmp_path, change, match):
    a = run_doc(tmp_path, "a", [("e1", 3000, 0.8, 0.3)])
    b = run_doc(tmp_path, "b", [("e1" if change.get("dup") else "e2", 4000, 0.8, 0.3)], **change.get("config", {}))
    doc_b = read_run(b)
    doc_b["records"][0].update(change.get("ref", {}))
    with pytest.raises(TrtkvError, match=match):
        merge_runs([read_run(a), doc_b])


def test_eval_merge_cli(tmp_path):
    a = run_doc(tmp_path, "a", [("e1", 3000, 0.8, 0.3)])
    b = run_doc(tmp_path, "b", [("e2", 2000, 0.7, 0.4)])
    r = CliRunner().invoke(main, ["eval-merge", str(a), str(b / "results.json"), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [x["engine"] for x in merged["records"]] == ["full (reference)", "e1", "e2"]
    assert (tmp_path / "m" / "pareto.png").is_file()
    (tmp_path / "bad.json").write_text("{not json")
    for args in ([str(a), str(tmp_path / "missing")], [str(a), str(tmp_path / "bad.json")], [str(a)]):
        r = CliRunner().invoke(main, ["eval-merge", *args, "--out", str(tmp_path / "x")])
        assert r.exit_code != 0 and "Traceback" not in r.output
        assert len([ln for ln in r.output.splitlines() if ln.strip()]) == 1, r.output
