"""The memory claims of the README, end to end on SmolLM2: an NVFP4 cache holds ~3.5x fewer bytes than fp16
for the same tokens, and ThinKV at budget 256 holds at most 12% of an fp16 cache over a 1,024-token
generation with a page count that stops growing, while the text stays readable."""
from __future__ import annotations

import pytest
from policy_matrix import coherent

from trtkv.api import SamplingParams

pytestmark = pytest.mark.model

ESSAY = ("Write a long, detailed essay about the history of mathematics, from ancient Babylon to modern computers. "
         "Cover many eras and people.")
# the README demo's sampling: SmolLM2-135M loops under plain greedy decoding, even with the full cache
DEMO_SAMPLING = dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=0)


def test_nvfp4_engine_bytes_and_text(engine_factory, load_engine):
    eng = load_engine(engine_factory("smollm2-135m", "full", kv_format="nvfp4"))
    res = eng.generate("Describe a day in the life of a lighthouse keeper.", SamplingParams(max_tokens=300))[0]
    s = res.stats
    cache = eng.core.cache
    pool = cache.pools[0]["nvfp4"]
    # per token and layer: 4-bit K and V codes, a value scale per 16 channels, 1/16 of a key-scale group
    slot = pool.fmt.slot_bytes(pool.H, pool.D) + pool.group_bytes / 16
    fp16_slot = 2 * pool.H * pool.D * 2
    assert fp16_slot / slot == pytest.approx(3.56, abs=0.01)  # the format itself
    assert s["kv_bytes_full"] / s["kv_bytes"] > 2.9  # plus page metadata, open page and the fp16 residual buffer
    ok, why = coherent(res.text)
    assert ok, f"{why}\n{res.text}"


@pytest.mark.slow
@pytest.mark.claim
def test_thinkv_budget_256_over_1024_tokens(engine_factory, load_engine):
    eng = load_engine(engine_factory("smollm2-135m", "thinkv", budget=256))
    pol = eng.core.policy
    pages = []
    step_end = type(pol).on_decode_step_end_batch

    def record(reqs, stats):
        step_end(pol, reqs, stats)
        for req in reqs:
            pages.append((req.seq.evicted_tokens > 0, sum(len(p) for p in req.seq.layers[0].pages.values())))

    pol.on_decode_step_end_batch = record
    try:
        res = eng.generate(ESSAY, SamplingParams(max_tokens=1024, ignore_eos=True, **DEMO_SAMPLING))[0]
    finally:
        del pol.on_decode_step_end_batch
    s = res.stats
    assert s["generated_tokens"] == 1024
    assert s["kv_bytes"] <= 0.12 * s["kv_bytes_full"], s
    first_anneal = next(i for i, (evicted, _) in enumerate(pages) if evicted)
    after = [n for _, n in pages[first_anneal:]]
    assert max(after) <= after[0] + 2, after  # flat: later tokens reuse the slots anneals free
    ok, why = coherent(res.text)
    assert ok, f"{why}\n{res.text}"
