"""Tiered KV memory on SmolLM2 (issue 15 "done when"): Proposition 1 (r = 0 => greedy tokens of ``full`` at
any beta) and beta = 0.3 holding at most half of full's device KV bytes, staging included."""
from __future__ import annotations

import pytest
from policy_matrix import one_thread

from trtkv.api import SamplingParams

assert one_thread
PROMPT = "Explain why the sky is blue, step by step."


@pytest.fixture(scope="module")
def smol(engine_factory, load_engine):
    def get(name, **params):
        return load_engine(engine_factory("smollm2-135m", name, **params))
    return get


@pytest.mark.model
def test_tiered_r0_equals_full_smol_short(smol):
    """The fast real-model check (in ``make test``): events every 16 steps, a 32-token window, 30% on device."""
    sp = SamplingParams(max_tokens=112, ignore_eos=True)
    ref = smol("full").generate(PROMPT, sp)[0]
    res = smol("tiered", beta=0.3, evict_ratio=0.0, interval=16, window=32).generate(PROMPT, sp)[0]
    assert res.token_ids == ref.token_ids
    s = res.stats
    assert s["tokens_host"] > 40 and s["tiered"]["evicted"] == 0
    assert s["kv_bytes_device"] < 0.8 * ref.stats["kv_bytes"]  # ~76%: the prompt and window dominate here


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("beta", [pytest.param(0.3, marks=pytest.mark.claim), 0.0, 0.7])
def test_proposition_1_r0_any_beta_equals_full_512(smol, beta):
    """r = 0: moving tokens between device and host changes nothing (paper Proposition 1), over 512 tokens
    with the spec's defaults (interval 64, window 128, sinks 4)."""
    sp = SamplingParams(max_tokens=512, ignore_eos=True)
    ref = smol("full").generate(PROMPT, sp)[0]
    res = smol("tiered", beta=beta, evict_ratio=0.0).generate(PROMPT, sp)[0]
    assert res.token_ids == ref.token_ids
    assert res.stats["tokens_host"] > 0


@pytest.mark.model
@pytest.mark.slow
def test_beta_03_holds_at_most_half_of_full_device_bytes_1024(smol):
    """beta = 0.3, r = 0 over 1,100 generated tokens: device KV bytes (pages + the two staging buffers) at most
    50% of full's, at the end and at the peak (numbers in docs/benchmarks.md, "Tiered KV memory")."""
    sp = SamplingParams(max_tokens=1100, ignore_eos=True)
    ref = smol("full").generate(PROMPT, sp)[0]
    res = smol("tiered", beta=0.3, evict_ratio=0.0).generate(PROMPT, sp)[0]
    assert res.token_ids == ref.token_ids
    s = res.stats
    assert s["kv_bytes_device"] <= 0.5 * ref.stats["kv_bytes"]
    assert s["peak_kv_bytes_device"] <= 0.5 * ref.stats["peak_kv_bytes"]
