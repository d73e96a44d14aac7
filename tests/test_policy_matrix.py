"""Every registered policy, through the shared matrix (tests/policy_matrix.py): budgets hold during a
generation longer than the budget, a budget above the length changes nothing, pages and per-request
state are freed, batching equals one-by-one, and the compressed cache behaves like full attention with
the evicted tokens masked. Tiny random model for the matrix; SmolLM2 for the key properties."""
from __future__ import annotations

import json

import pytest
import torch
from policy_matrix import (MATRIX, Probe, cases, coherent, evicts, full_precision, masked_reference_logits, one_thread,
                           smol_params)

from trtkv.api import SamplingParams
from trtkv.errors import TrtkvError
from trtkv.policies import POLICIES, make_policy

RAW = SamplingParams(max_tokens=100, ignore_eos=True, chat=False)
PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "Once upon a time, in a land far away, there lived a wise old king who loved puzzles and riddles.",
           "Numbers: 1, 2, 3"]
CASES = cases()
IDS = [f"{n}-{lvl}" for n, lvl, _ in CASES]
assert one_thread  # autouse: one intra-op thread for this module


@pytest.fixture(scope="module")
def tiny(engine_factory, load_engine, tiny_ckpt):
    def get(name, params):
        return load_engine(engine_factory(tiny_ckpt, name, **params))
    return get


# --- registry -------------------------------------------------------------------------------------
def test_matrix_covers_every_policy():
    names = [e["name"] for e in MATRIX]
    missing = sorted(set(POLICIES) - set(names))
    assert not missing, f"registered policies without a matrix entry (one line in tests/policy_matrix.py): {missing}"
    assert len(names) == len(set(names)) and set(names) <= set(POLICIES)
    for e in MATRIX:
        assert len(e["params"]) == 2, e["name"]
        for p in e["params"]:
            make_policy(e["name"], p)  # valid parameters


def test_policies_list_one_line_each():
    from click.testing import CliRunner

    from trtkv.cli import main

    out = CliRunner().invoke(main, ["policies", "list", "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.output)}
    assert set(rows) == set(POLICIES)
    for name, r in rows.items():
        assert r["description"] and "\n" not in r["description"], name
        assert len(r["description"]) <= 120, name
    text = CliRunner().invoke(main, ["policies", "list"]).output
    assert all(name in text for name in POLICIES)


@pytest.mark.parametrize("name,params", [
    ("h2o", {"budget": 0}), ("h2o", {"recent_ratio": 1.5}), ("tova", {"budget": 4, "evict_every": 4}),
    ("snapkv", {"budget": 16, "window_size": 32}), ("snapkv", {"pooling": "median"}),
    ("rkv", {"budget": 10, "window_size": 8, "n_sink": 4}), ("rkv", {"mix_lambda": 2}),
    ("kivi", {"bits": 3}), ("kivi", {"budget": 256}), ("kivi", {"bits": 2, "kv_format": "int4"}),
    ("lazyeviction", {"window": 256, "budget": 256}), ("lazyeviction", {"score": "cubic"}),
    ("lazyeviction", {"alpha": -1}), ("ams", {"scorer": "oracle"}), ("ams", {"delta": 0}),
    ("ams", {"scorer": "expected_attention", "hs": 4}), ("ams", {"mode": "strict"}),
])
def test_invalid_parameters_are_rejected(name, params):
    with pytest.raises(TrtkvError, match=f"invalid parameters for policy '{name}'"):
        make_policy(name, params)


def test_params_round_trip():
    for name, _, params in CASES:
        pol = make_policy(name, params)
        again = make_policy(name, pol.params())
        assert again.params() == pol.params(), name


def test_compacting_policies_force_compact_cache(engine_factory, tiny_ckpt):
    from trtkv.artifacts.engine_dir import read_manifest

    assert read_manifest(engine_factory(tiny_ckpt, "rkv", budget=48)).cache.eviction == "compact"
    assert read_manifest(engine_factory(tiny_ckpt, "ams", budget=48)).cache.eviction == "compact"
    inplace = engine_factory(tiny_ckpt, "rkv", budget=48, compaction=False)
    assert read_manifest(inplace).cache.eviction == "inplace"
    with pytest.raises(TrtkvError, match="eviction=compact"):
        engine_factory(tiny_ckpt, "rkv", budget=40, eviction="inplace")


# --- behaviour on the tiny model ------------------------------------------------------------------
@pytest.mark.parametrize("name,level,params", CASES, ids=IDS)
def test_budget_respected(tiny, name, level, params):
    eng = tiny(name, params)
    pol = eng.core.policy
    with Probe(eng) as probe:
        res = eng.generate(PROMPTS[1], RAW)[0]
    P, N = res.stats["prompt_tokens"], res.stats["generated_tokens"]
    assert N == RAW.max_tokens
    bound = pol.max_live_tokens(P, N)
    attended = max(probe.peak.values())
    assert attended <= bound, (attended, bound)
    assert res.stats["peak_live_tokens"] <= bound
    if evicts(name, params):
        assert bound < P + N, "the case must generate past the budget"
        assert res.stats["evicted_tokens"] > 0
        assert res.stats["live_tokens"] <= bound
        if name in ("streamingllm", "h2o", "tova"):  # hard caps
            assert attended <= pol.budget


@pytest.mark.parametrize("name,level,params", CASES, ids=IDS)
def test_budget_above_length_equals_full(tiny, name, level, params):
    if not evicts(name, params) or not full_precision(name, params):
        pytest.skip("no budget / not full precision: nothing to compare with full")
    ref = tiny("full", {}).generate(PROMPTS, RAW)
    res = tiny(name, {**params, "budget": 4096}).generate(PROMPTS, RAW)
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    assert all(r.stats["evicted_tokens"] == 0 for r in res)


@pytest.mark.parametrize("name,level,params", CASES, ids=IDS)
def test_no_leaks_state_freed_batching(tiny, name, level, params):
    eng = tiny(name, params)
    pol = eng.core.policy
    before = {k: (type(v), len(v) if hasattr(v, "__len__") else None) for k, v in vars(pol).items()}
    params_diff = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False) for n in (100, 60, 80)]
    with Probe(eng) as probe:
        batched = eng.generate(PROMPTS, params_diff)
    alone = [eng.generate(p, sp)[0] for p, sp in zip(PROMPTS, params_diff)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    core = eng.core
    assert core.cache.pages_in_use() == 0
    assert not core.cache.seqs and not eng.scheduler.running and not eng.scheduler.waiting
    assert probe.ctxs and all(ctx.state is None for ctx in probe.ctxs)
    after = {k: (type(v), len(v) if hasattr(v, "__len__") else None) for k, v in vars(pol).items()}
    assert after == before  # no per-request state kept on the policy object


@pytest.mark.parametrize("name,level,params", CASES, ids=IDS)
def test_compressed_equals_masked_full_attention(tiny, name, level, params):
    """The engine's logits equal a dense re-run that attends exactly the tokens the cache held at each
    step and layer (true RoPE positions; in-place reuse and gather compaction are invisible)."""
    if not full_precision(name, params):
        pytest.skip("quantized storage: a dense reference would need the codec")
    eng = tiny(name, params)
    sp = SamplingParams(max_tokens=60, ignore_eos=True, chat=False)
    with Probe(eng, record_sets=True, record_logits=True) as probe:
        res = eng.generate(PROMPTS[1], sp)[0]
    rid = next(iter(probe.sets))
    prompt_ids = eng.encode_prompt(PROMPTS[1], False)
    ref = masked_reference_logits(eng, prompt_ids, res.token_ids, probe.sets[rid])
    got = torch.stack(probe.logits[rid])
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (ref.argmax(-1).tolist() == res.token_ids)


# --- SmolLM2 --------------------------------------------------------------------------------------
SMOL = [(e["name"], smol_params(e)) for e in MATRIX if e["name"] != "full"]


@pytest.mark.model
@pytest.mark.parametrize("name,params", SMOL, ids=[n for n, _ in SMOL])
def test_smol_budget_and_leaks(engine_factory, load_engine, name, params):
    eng = load_engine(engine_factory("smollm2-135m", name, **params))
    pol = eng.core.policy
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    with Probe(eng) as probe:
        res = eng.generate(["Write a short story about a robot.", "What is 2+2?"], sp)
    for r in res:
        P, N = r.stats["prompt_tokens"], r.stats["generated_tokens"]
        assert N == 60
        assert r.stats["peak_live_tokens"] <= pol.max_live_tokens(P, N)
        if pol.budget is not None:
            assert r.stats["evicted_tokens"] > 0
    assert max(probe.peak.values()) <= max(pol.max_live_tokens(r.stats["prompt_tokens"], 60) for r in res)
    assert eng.core.cache.pages_in_use() == 0 and not eng.core.cache.seqs
    assert all(ctx.state is None for ctx in probe.ctxs)
    ok, why = coherent(res[0].text)
    assert ok or len(res[0].text.split()) < 30, why


COHERENCE_PROMPT = "Describe a day in the life of a lighthouse keeper."
# budget 256 over ~340 tokens; the periodic policies get a cadence that acts within 300 tokens ("cadence")
COHERENCE = [(e["name"], ({"budget": 256, **e.get("cadence", {})} if evicts(e["name"], {}) else {}))
             for e in MATRIX]


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("name,params", COHERENCE, ids=[n for n, _ in COHERENCE])
def test_smol_budget_256_is_coherent(engine_factory, load_engine, name, params):
    """~300 greedy tokens of SmolLM2 at budget 256 read as English (samples in docs/policies.md)."""
    eng = load_engine(engine_factory("smollm2-135m", name, **params))
    res = eng.generate(COHERENCE_PROMPT, SamplingParams(max_tokens=300, ignore_eos=True))[0]
    assert res.stats["generated_tokens"] == 300
    if eng.core.policy.budget is not None:
        bound = eng.core.policy.max_live_tokens(res.stats["prompt_tokens"], 300)
        assert res.stats["peak_live_tokens"] <= bound
        assert res.stats["evicted_tokens"] > 0
    ok, why = coherent(res.text)
    assert ok, f"{why}\n{res.text}"
