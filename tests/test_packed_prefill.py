"""Packed prefill (runtime/prefill.py): the scheduler prefills a group of admitted prompts in one pass.

* Every request gets what its own prefill gives: the same first-token logits (to float rounding), the same
  tokens to the end and the same cache state — for the full cache, quantized formats (whole groups and a
  buffered or flushed tail), scorers that read prefill statistics, prompts of one length and of several.
* The scheduler packs up to ``prefill_tokens`` prompt tokens a pass (the bench's timer sees one call per group,
  each request its share of the time), and a group whose pass fails is taken back and prefilled one request
  at a time, so only the bad request fails.
"""
from __future__ import annotations

import pytest
import torch
from policy_matrix import one_thread

from trtkv.api import Engine, SamplingParams
from trtkv.runtime.request import Request
from trtkv.runtime.sampling import make_generator
from trtkv.runtime.scheduler import Scheduler

assert one_thread
RAW = SamplingParams(max_tokens=12, ignore_eos=True, chat=False)
POLICIES = [("full", None, {}), ("thinkv", 32, {"tau": 16}), ("kivi", None, {}), ("snapkv", 48, {}),
            ("tova", 40, {}), ("h2o", 40, {})]


@pytest.fixture(scope="module")
def tiny(engine_factory, tiny_ckpt):
    def get(name, budget=None, **settings):
        return Engine.load(engine_factory(tiny_ckpt, name, budget=budget, **settings))
    return get


def prompts(lens: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate(lens)]


def run(core, ids: list[list[int]], prefill_tokens: int, timer=None) -> list[Request]:
    params = RAW.validate(2048)
    reqs = [Request(9000 + i, "", p, params, make_generator(i), 2048) for i, p in enumerate(ids)]
    sched = Scheduler(core, 64, step_timer=timer, prefill_tokens=prefill_tokens)
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    return reqs


@pytest.mark.parametrize("name,budget,settings", POLICIES, ids=[p[0] for p in POLICIES])
@pytest.mark.parametrize("lens", [[40, 40, 40], [19, 64, 33, 50]], ids=["one-length", "mixed"])
def test_packed_prefill_gives_each_request_its_own(tiny, name, budget, settings, lens):
    eng = tiny(name, budget, **settings)
    ids = prompts(lens)
    alone = eng.make_core()
    one = [Request(100 + i, "", p, RAW.validate(2048), make_generator(i), 2048) for i, p in enumerate(ids)]
    for r in one:
        alone.prefill(r)
    packed = eng.make_core()
    many = [Request(100 + i, "", p, RAW.validate(2048), make_generator(i), 2048) for i, p in enumerate(ids)]
    packed.prefill_many(many)
    for a, b in zip(one, many):
        torch.testing.assert_close(b.last_logits, a.last_logits, rtol=1e-5, atol=1e-5)
        assert b.generated == a.generated
        for layer in range(eng.arch.num_hidden_layers):
            assert b.ctx.all_positions(layer).tolist() == a.ctx.all_positions(layer).tolist()
        assert packed.cache.seq_bytes(b.ctx.seq) == alone.cache.seq_bytes(a.ctx.seq)
    # to the end, through the scheduler: packed groups vs one prompt a pass
    by_one = run(eng.make_core(), ids, prefill_tokens=1)
    by_group = run(eng.make_core(), ids, prefill_tokens=8192)
    assert [r.result.token_ids for r in by_group] == [r.result.token_ids for r in by_one]
    assert all(len(r.generated) == RAW.max_tokens for r in by_group)


def test_scheduler_packs_up_to_prefill_tokens_and_times_each_share(tiny):
    eng = tiny("full")
    calls = []

    def timer(phase, reqs, seconds):
        if phase == "prefill":
            calls.append(len(reqs))

    run(eng.make_core(), prompts([30] * 7), prefill_tokens=60, timer=timer)
    assert calls == [2, 2, 2, 1]
    calls.clear()
    run(eng.make_core(), prompts([30] * 7), prefill_tokens=8192, timer=timer)
    assert calls == [7]


def test_a_failing_pass_falls_back_to_one_request_at_a_time(tiny, monkeypatch):
    """A request whose reservation understated its pages fills the pool inside a packed pass: the pass is taken
    back, the requests are prefilled one at a time, that request fails alone with the pool's line, and the
    others finish with the tokens they get alone."""
    from trtkv.cache.budget import pages_needed

    params = RAW.validate(2048)
    ids = prompts([24, 24, 200])
    probe = tiny("full")
    alone = [run(probe.make_core(), [p], 1)[0].result.token_ids for p in ids[:2]]
    need = pages_needed(probe.policy, probe.core.cache.cfg, 24, RAW.max_tokens)["fp32"]
    eng = tiny("full")  # (a core holds its engine's model weakly)
    core = eng.make_core(max_pages=2 * need + 2)
    reqs = [Request(500 + i, "", p, params, make_generator(i), 2048) for i, p in enumerate(ids)]
    reqs[2].kv_pages = {"fp32": 1}  # admission believes the long prompt needs one page
    sched = Scheduler(core, 8)
    for r in reqs:
        sched.add(r)
    sched.step()
    assert reqs[2].finish_reason == "error" and "KV pool is full" in reqs[2].error
    while sched.has_work:
        sched.step()
    assert [r.result.token_ids for r in reqs[:2]] == alone
    assert core.cache.pages_in_use() == 0 and not core.cache.seqs


def test_device_out_of_memory_in_prefill_fails_that_request_alone(tiny, monkeypatch):
    """A prompt whose prefill runs the device out of memory (``torch.OutOfMemoryError``, here raised for the
    long prompt) fails with one line; the packed pass it was in is rerun one request at a time and the others
    finish with their own tokens."""
    import trtkv.runtime.core as core_mod

    eng = tiny("full")
    ids = prompts([24, 90, 24])
    alone = [run(eng.make_core(), [p], 1)[0].result.token_ids for p in (ids[0], ids[2])]
    real = core_mod.prefill_packed

    def short_of_memory(core, reqs):
        if any(r.prompt_len == 90 for r in reqs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real(core, reqs)

    monkeypatch.setattr(core_mod, "prefill_packed", short_of_memory)
    core = eng.make_core()
    reqs = run(core, ids, 8192)
    assert reqs[1].finish_reason == "error" and "device out of memory" in reqs[1].error
    assert "\n" not in reqs[1].error
    assert [reqs[0].result.token_ids, reqs[2].result.token_ids] == alone
    assert core.cache.pages_in_use() == 0 and not core.cache.seqs
