"""Tensor parallelism (trtkv/models/sharding.py, trtkv/distributed): two gloo ranks give TP=1's greedy tokens for
every policy, each rank holds half the weights and KV bytes, and a lost rank ends generate and serve with one
error line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from policy_matrix import MATRIX, smol_params
from tp_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The answer to the question is", "Let me think step by step about the problem"]
# the list, and the rest of the matrix (cheap on the tiny model)
SMOL_POLICIES = ("full", "streamingllm", "h2o", "snapkv", "rkv", "kivi", "thinkv", "tiered", "arborkv")


def generate_all(engines: dict, prompts: list[str], tp: int, max_tokens: int = 64) -> dict:
    """Greedy tokens of every engine (``name -> (path, n)``), engines of one model sharing its weights."""
    from trtkv.api import Engine, SamplingParams

    shared: dict = {}
    out = {}
    for name, (path, n) in engines.items():
        eng = Engine.load(path, tp=tp, model_cache=shared)
        res = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n,
                                                   chat=False))
        out[name] = [r.token_ids for r in res]
    return out


def prefill_logits(path: str, prompt: str, tp: int):
    from trtkv.api import Engine, SamplingParams

    eng = Engine.load(path, tp=tp)
    req = eng.make_request(prompt, SamplingParams(max_tokens=1, chat=False))
    eng.core.prefill(req)
    return req.last_logits.numpy().copy()  # (a tensor would travel as shared memory its rank frees at exit)


def weight_and_kv_bytes(path: str, tp: int) -> tuple[int, int, int]:
    """(this rank's weight bytes, its KV bytes after a 24-token generation, its KV heads)."""
    from trtkv.api import Engine, SamplingParams
    from trtkv.bench.engines import step_weight_bytes

    eng = Engine.load(path, tp=tp)
    res = eng.generate(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True, chat=False))[0]
    return step_weight_bytes(eng), res.stats["kv_bytes"], eng.core.cache.cfg.num_kv_heads


def _hard(name: str) -> dict:
    return dict(next(e for e in MATRIX if e["name"] == name)["params"][1])


def test_shard_plan_splits_heads_mlp_and_vocab(tiny_ckpt):
    from trtkv.models.config import ModelArch
    from trtkv.models.registry import resolve_model
    from trtkv.models.sharding import ShardPlan

    smol = ModelArch.from_hf_config(resolve_model("smollm2-135m").config)
    p = ShardPlan.for_arch(smol, 1, 2)  # 3 KV heads: replicated; 1536 MLP channels: split
    assert not p.heads_sharded and p.mlp_sharded and p.local_arch(smol).num_key_value_heads == 3
    assert p.mlp_rows(smol) == slice(768, 1536) and p.vocab_rows(smol) == slice(24576, 49152)
    odd = ShardPlan.for_arch(smol, 2, 3)  # 49152 / 3: the last slice is short by nothing; 1536 / 3 splits
    assert odd.vocab_rows(smol) == slice(32768, 49152) and odd.local_arch(smol).intermediate_size == 512
    short = ShardPlan.for_arch(smol, 6, 7)  # 49152 / 7 rows a rank: the last holds fewer, padded
    assert short.vocab_chunk * 7 >= 49152 and short.vocab_rows(smol).stop == 49152


def test_shards_reassemble_the_model(tiny_ckpt):
    """Every rank's slices, put back together, are the model's weights."""
    from trtkv.models.loader import build_model, read_arch, weight_files
    from trtkv.models.sharding import ShardPlan, shard_model

    arch = read_arch(tiny_ckpt)
    full = build_model(arch, torch.float32, "cpu", weight_files(tiny_ckpt))
    parts = [shard_model(full, ShardPlan.for_arch(arch, r, 2)) for r in range(2)]
    for i, layer in enumerate(full.model.layers):
        for name, dim in (("self_attn.q_proj", 0), ("self_attn.k_proj", 0), ("self_attn.o_proj", 1),
                          ("mlp.gate_proj", 0), ("mlp.down_proj", 1)):
            got = torch.cat([p.model.layers[i].get_submodule(name).weight for p in parts], dim)
            assert torch.equal(got, layer.get_submodule(name).weight), name
    assert torch.equal(torch.cat([p.lm_head.weight for p in parts])[:arch.vocab_size], full.lm_head.weight)


@pytest.mark.parametrize("synthetic", [False, True])
def test_a_rank_loads_only_its_slices_and_gets_the_same_shard(tiny_ckpt, synthetic):
    """``load_shard`` reads a rank's slices from the checkpoint (or draws the synthetic weights a tensor at a time)
    and gives exactly what slicing the whole loaded model gives."""
    from trtkv.models.loader import build_model, read_arch, weight_files
    from trtkv.models.sharding import ShardPlan, load_shard, shard_model

    arch = read_arch(tiny_ckpt)
    files = None if synthetic else weight_files(tiny_ckpt)
    full = build_model(arch, torch.float32, "cpu", files, seed=3)
    for rank in range(2):
        plan = ShardPlan.for_arch(arch, rank, 2)
        a = dict(shard_model(full, plan).named_parameters())
        b = dict(load_shard(arch, plan, torch.float32, "cpu", files, seed=3).named_parameters())
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_tp2_gives_tp1_tokens_for_every_policy_tiny(tiny_ckpt, engine_factory):
    """Even KV heads (2 over 2 ranks): every policy of the matrix at its squeezing parameters, greedy, 64 tokens,
    two prompts batched; ArborKV with two forked samples. Bit-identical tokens on both ranks and against TP=1."""
    engines = {}
    for e in MATRIX:
        if e["name"].startswith("thinkv-"):
            continue
        engines[e["name"]] = (str(engine_factory(tiny_ckpt, e["name"], **_hard(e["name"]))),
                              2 if e["name"] == "arborkv" else 1)
    ref = generate_all(engines, PROMPTS, 1)
    rank0, rank1 = run_ranks(generate_all, 2, engines, PROMPTS, 2)
    assert rank0 == rank1
    for name in engines:
        assert rank0[name] == ref[name], name


def test_tp2_logits_within_the_measured_tolerance(tiny_ckpt, engine_factory):
    """The row-parallel all-reduce sums two partial products where one rank sums one: logits differ in the last
    bits only (measured on the tiny model: max |diff| ~1e-6 of logits ~1; the bound is 1e-4)."""
    path = str(engine_factory(tiny_ckpt, "full"))
    ref = torch.from_numpy(prefill_logits(path, PROMPTS[1], 1))
    r0, r1 = (torch.from_numpy(x) for x in run_ranks(prefill_logits, 2, path, PROMPTS[1], 2))
    assert torch.equal(r0, r1)  # every rank holds the same (gathered) logits
    diff = (r0 - ref).abs().max().item()
    print(f"TP=2 vs TP=1 prefill logits: max |diff| {diff:.3g}, max |logit| {ref.abs().max().item():.3g}")
    assert diff < 1e-4 * max(1.0, ref.abs().max().item()), diff
    assert r0.argmax() == ref.argmax()


def test_tp2_ranks_hold_half_the_weights_and_kv(tiny_ckpt, engine_factory):
    path = str(engine_factory(tiny_ckpt, "full"))
    w1, kv1, h1 = weight_and_kv_bytes(path, 1)
    (w0, kv0, h0), (w_1, kv_1, _) = run_ranks(weight_and_kv_bytes, 2, path, 2)
    assert (h1, h0) == (2, 1)
    # K/V codes halve; the page metadata and block-table entries a page carries (36 B a page here) do not
    assert kv0 == kv_1 and kv1 < 2 * kv0 < 1.01 * kv1, (kv0, kv1)
    from trtkv.models.loader import read_arch

    a = read_arch(tiny_ckpt)
    # every projection and the (tied) LM head split in two; the RMS norm weights are replicated
    norms = (2 * a.num_hidden_layers + 1) * a.hidden_size * 4
    assert w0 == w_1 and w0 == (w1 - norms) // 2 + norms, (w0, w1)


# KV formats of 2-4 bits: a last-bit difference of the hidden state (the MLP's all-reduce sums two partial products)
# can move a code across a rounding boundary, and greedy decoding then follows another near-tie some tokens later.
# Measured on SmolLM2 (Sapphire Rapids, 2026-11-29): KIVI diverged at token 49, ThinKV at 36; every other policy of
# the list gave the same 64 tokens.
QUANTIZING = {"kivi", "thinkv"}
SAME_PREFIX = 16


@pytest.mark.model  # ~2 min on the 2-core CI machine: in `make test`
def test_tp2_gives_tp1_tokens_smollm2(smol_ckpt, engine_factory):
    """Replicated KV heads (SmolLM2 has 3) with the MLP and LM head split: the issue's policies, greedy, 64
    tokens; ArborKV with two forks. Bit-identical tokens for policies that keep K/V in 16 bits; the quantizing
    ones at least the first ``SAME_PREFIX`` (see above); logits within 1e-4 of their scale."""
    engines = {}
    for name in SMOL_POLICIES:
        entry = next(e for e in MATRIX if e["name"] == name)
        engines[name] = (str(engine_factory(smol_ckpt, name, **smol_params(entry))), 2 if name == "arborkv" else 1)
    prompts = ["Solve step by step: a train travels 60 km in 45 minutes. What is its speed in km/h?"]
    ref = generate_all(engines, prompts, 1)
    rank0, rank1 = run_ranks(generate_all, 2, engines, prompts, 2)
    assert rank0 == rank1
    diverged = {name: [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                       for x, y in zip(ref[name], rank0[name])] for name in engines}
    print("TP=2 vs TP=1 first differing token:", diverged)
    for name, firsts in diverged.items():
        if name in QUANTIZING:
            assert all(f is None or f >= SAME_PREFIX for f in firsts), (name, firsts)
        else:
            assert firsts == [None] * len(firsts), (name, firsts)
    path = engines["full"][0]
    lg = torch.from_numpy(prefill_logits(path, prompts[0], 1))
    lg2 = torch.from_numpy(run_ranks(prefill_logits, 2, path, prompts[0], 2)[0])
    diff = (lg2 - lg).abs().max().item()
    print(f"SmolLM2 TP=2 vs TP=1 prefill logits: max |diff| {diff:.3g}, max |logit| {lg.abs().max().item():.3g}")
    assert diff < 1e-4 * lg.abs().max().item()


def _trtkv(*args, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TRTKV_TP_TIMEOUT": "30"}
    return subprocess.Popen([sys.executable, "-m", "trtkv", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_cli_generate_tp2_prints_tp1_text(tiny_ckpt, engine_factory):
    path = str(engine_factory(tiny_ckpt, "h2o", **_hard("h2o")))
    outs = []
    for tp in ("1", "2"):
        p = _trtkv("generate", path, "--prompt", PROMPTS[0], "--raw", "--max-tokens", "40", "--json", "--tp", tp)
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
        outs.append(json.loads(out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["text"] == outs[1]["text"]
    # the rank's own share of the KV bytes: half of TP=1's K/V (2 KV heads over 2 ranks), page metadata whole
    kv1, kv2 = outs[0]["stats"]["kv_bytes"], outs[1]["stats"]["kv_bytes"]
    assert kv1 < 2 * kv2 < 1.01 * kv1


def test_killing_a_rank_ends_generate_with_one_error_line(tiny_ckpt, engine_factory):
    path = str(engine_factory(tiny_ckpt, "full"))
    p = _trtkv("generate", path, "--prompt", PROMPTS[0], "--raw", "--max-tokens", "1900", "--ignore-eos",
               "--tp", "2")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not p.stdout.read1(64):  # rank 0 streams: generation is under way
            assert p.poll() is None, p.stderr.read().decode()
        workers = _children(p.pid)
        assert workers, "no rank 1 started"
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert p.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("trtkv: error: tensor-parallel rank lost"), lines
    assert took < 30  # well within the collective timeout: a closed connection fails at once


@pytest.mark.serve
def test_serve_tp2_answers_and_ends_when_a_rank_dies(tiny_ckpt, engine_factory):
    from serve_helpers import HOST, free_ports, stop_process, wait_ready

    from trtkv.serve import client

    path = str(engine_factory(tiny_ckpt, "full"))
    http, grpc, metrics, tm = free_ports(4)
    p = _trtkv("serve", path, "--host", HOST, "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--trtkv-metrics-port", str(tm), "--tp", "2")
    try:
        try:
            wait_ready(f"{HOST}:{http}", "trtkv", 180, p)
        except RuntimeError:
            raise AssertionError(p.stderr.read().decode(errors="replace")[-2000:]) from None
        got = client.http_generate(f"{HOST}:{http}", PROMPTS[0], max_tokens=6)
        assert got["generated_tokens"] == 6
        workers = [w for w in _children(p.pid)
                   if "trtkv" in Path(f"/proc/{w}/cmdline").read_bytes().decode(errors="replace")]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        code = p.wait(timeout=90)
    finally:
        if p.poll() is None:
            stop_process(p)
    log = p.stderr.read().decode(errors="replace") + p.stdout.read().decode(errors="replace")
    assert code == 1, log[-3000:]
    assert "tensor-parallel" in log


def test_bench_tp2_reports_per_rank_weight_and_kv_bytes(tiny_ckpt, engine_factory, tmp_path):
    path = str(engine_factory(tiny_ckpt, "full"))
    docs = {}
    for tp in ("1", "2"):
        p = _trtkv("bench", path, "--tp", tp, "--batch-sizes", "2", "--prompt-len", "16", "--gen-len", "8",
                   "--prompt", "ids", "--no-warmup", "--out", str(tmp_path / tp))
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
        docs[tp] = json.loads((tmp_path / tp / "results.json").read_text())
    e1, e2 = docs["1"]["engines"][0], docs["2"]["engines"][0]
    assert (e1["tp"], e2["tp"], e1["kv_heads_per_rank"], e2["kv_heads_per_rank"]) == (1, 2, 2, 1)
    assert e1["weight_bytes"] < 2 * e2["weight_bytes"] < 1.01 * e1["weight_bytes"]  # (replicated norms)
    r1, r2 = docs["1"]["results"][0], docs["2"]["results"][0]
    assert r1["kv_bytes_per_request_peak"] < 2 * r2["kv_bytes_per_request_peak"] < 1.01 * r1["kv_bytes_per_request_peak"]
    assert any("tensor parallel over 2 ranks" in n for n in docs["2"]["notes"])


def test_tp_without_its_ranks_is_one_error(tiny_ckpt, engine_factory, tmp_path):
    from trtkv.api import Engine
    from trtkv.errors import TrtkvError
    from trtkv.serve.deploy import deploy

    path = str(engine_factory(tiny_ckpt, "full"))
    with pytest.raises(TrtkvError, match="not one of 2 ranks"):
        Engine.load(path, tp=2)
    with pytest.raises(TrtkvError, match="--tp 2 runs dense weights with --runtime torch"):
        Engine.load(path, tp=2, runtime="torch-compile")
    from trtkv.build.builder import build_engine

    tp2 = build_engine(str(tiny_ckpt), "full", tmp_path / "tp2", quiet=True, tp=2)
    with pytest.raises(TrtkvError, match="tensor-parallel ranks"):
        deploy(tp2, tmp_path / "repo")
    with pytest.raises(TrtkvError, match="--tp 2 shards dense weights"):
        build_engine(str(tiny_ckpt), "full", tmp_path / "q", quiet=True, tp=2, weights="int8")


def search_record(path: str, tp: int) -> dict:
    from trtkv.api import Engine
    from trtkv.search import SearchConfig

    eng = Engine.load(path, tp=tp)
    rec = eng.search("4 9 10 13", SearchConfig(branching=2, depth=3, expansions=8, node_tokens=16, seed=0),
                     task="game24")
    return {k: rec[k] for k in ("answer", "expansions", "peak_cached_tokens", "rehydrations")}


def test_tree_search_under_tp2_is_tp1s(tiny_ckpt, engine_factory):
    """ArborKV's tree (forks, re-stores and rehydration's prefix prefill over this rank's heads) under TP=2."""
    path = str(engine_factory(tiny_ckpt, "arborkv", kv_ratio=0.5, k_min=4))
    ref = search_record(path, 1)
    assert ref["expansions"] == 8 and ref["rehydrations"] >= 1
    assert run_ranks(search_record, 2, path, 2) == [ref, ref]


def test_eval_fidelity_tp2_matches_tp1(tiny_ckpt, engine_factory, tmp_path):
    path = str(engine_factory(tiny_ckpt, "h2o", **_hard("h2o")))
    recs = {}
    for tp in ("1", "2"):
        p = _trtkv("eval", path, "--task", "fidelity", "--limit", "2", "--max-tokens", "32", "--recall-layers", "all",
                   "--tp", tp, "--out", str(tmp_path / tp))
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
        recs[tp] = json.loads((tmp_path / tp / "results.json").read_text())["records"][1]
    a, b = recs["1"], recs["2"]
    assert a["top1_agreement"] == b["top1_agreement"] and a["attn_recall"] == b["attn_recall"]
    assert abs(a["mean_kl"] - b["mean_kl"]) < 1e-5
    assert a["kv_vs_reference_mean"] == b["kv_vs_reference_mean"]
