"""Policy `full` on SmolLM2 (fp32, CPU) is token-identical to transformers' own greedy `generate`,
one prompt at a time and with prompts of different lengths batched together."""
from __future__ import annotations

import pytest
import torch

from trtkv.api import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [
    "Write a short poem about the sea.",
    "List three prime numbers and explain why they are prime. Then tell a long story about a cat.",
    "Explain, step by step, how to compute the area of a circle of radius 3, and then describe in detail "
    "how the ancient Greeks approximated the number pi using polygons inscribed in a circle.",
]
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def hf_model(smol_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_ckpt), dtype=torch.float32).eval()


def hf_greedy(hf_model, ids: list[int], eos: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    return out[: out.index(eos)] if eos in out else out  # trtkv leaves EOS out of token_ids


def test_batched_greedy_matches_transformers(engine_factory, load_engine, smol_ckpt, hf_model):
    eng = load_engine(engine_factory("smollm2-135m", "full"))
    params = SamplingParams(max_tokens=NEW_TOKENS)
    results = eng.generate(PROMPTS, params)  # different lengths, one batch
    lengths = {len(eng.encode_prompt(p, True)) for p in PROMPTS}
    assert len(lengths) == len(PROMPTS)
    eos = eng.tokenizer.eos_token_id
    for prompt, res in zip(PROMPTS, results):
        ref = hf_greedy(hf_model, eng.encode_prompt(prompt, True), eos)
        assert res.token_ids == ref
    assert sum(len(r.token_ids) for r in results) >= 2 * NEW_TOKENS  # at least two ran the full 128 tokens
    assert eng.core.cache.pages_in_use() == 0 and not eng.core.cache.seqs


def test_single_prompt_matches_batched(engine_factory, load_engine):
    eng = load_engine(engine_factory("smollm2-135m", "full"))
    params = SamplingParams(max_tokens=48)
    batched = eng.generate(PROMPTS, params)
    alone = [eng.generate(p, params)[0] for p in PROMPTS]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]


def test_repetition_penalty_matches_transformers(engine_factory, load_engine, hf_model):
    """Greedy with a repetition penalty: the same rule as transformers (prompt ids count as seen)."""
    eng = load_engine(engine_factory("smollm2-135m", "full"))
    res = eng.generate(PROMPTS[0], SamplingParams(max_tokens=64, repetition_penalty=1.3))[0]
    ids = eng.encode_prompt(PROMPTS[0], True)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                repetition_penalty=1.3)[0, len(ids):].tolist()
    eos = eng.tokenizer.eos_token_id
    assert res.token_ids == (out[: out.index(eos)] if eos in out else out)
    plain = eng.generate(PROMPTS[0], SamplingParams(max_tokens=64))[0]
    assert res.token_ids != plain.token_ids  # the penalty did something


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: logits on the GPU, the generator on the CPU")
def test_seeded_sampling_of_gpu_logits_with_a_cpu_generator():
    """``api.make_request`` seeds a CPU generator; a GPU engine's logits are drawn from it (this raised on an
    H200), and the draw equals the same draw from the same probabilities on the CPU."""
    from trtkv.runtime.sampling import make_generator, sample_next

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(3)]
    on_gpu = sample_next(logits.cuda(), params, [make_generator(s) for s in range(3)])
    on_cpu = sample_next(logits, params, [make_generator(s) for s in range(3)])
    assert on_gpu == on_cpu
