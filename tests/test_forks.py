"""Forked sequences sharing pages (cache/forks.py, runtime/forking.py) and SamplingParams(n=K)."""
from __future__ import annotations

import pytest

from trtkv.runtime.sampling import SamplingParams

PROMPT = "Count from one to ten in words, separated by commas:"


@pytest.fixture(scope="module")
def tiny_full(engine_factory, load_engine, tiny_ckpt):
    return load_engine(engine_factory(tiny_ckpt, "full"))


def _run_core(engine, reqs):
    from trtkv.runtime.scheduler import Scheduler

    core = engine.make_core()
    sched = Scheduler(core)
    for r in reqs:
        sched.add(r)
    peak = 0
    while sched.has_work:
        sched.step()
        peak = max(peak, core.cache.engine_bytes())
    return core, peak


def test_forked_greedy_child_equals_prompt_run_alone(tiny_full):
    e = tiny_full
    alone = e.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    res = e.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, n=3))
    assert len(res) == 3
    assert [r.stats["sample_index"] for r in res] == [0, 1, 2]
    for r in res:
        assert r.token_ids == alone.token_ids
        assert r.stats["prompt_tokens"] == alone.stats["prompt_tokens"]


def test_n4_holds_prompt_pages_once(tiny_full):
    e = tiny_full
    p = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3)
    one = e.make_request(PROMPT, p)
    core1, peak1 = _run_core(e, [one])
    prompt_len = one.prompt_len
    forked = e.make_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, n=4))
    core4, peak4 = _run_core(e, [forked])
    separate = [e.make_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3 + i))
                for i in range(4)]
    core_sep, peak_sep = _run_core(e, separate)
    bs = core4.cache.cfg.block_size
    page = core4.cache.pools[0][next(iter(core4.cache.pools[0]))].page_bytes
    layers = core4.arch.num_hidden_layers
    prompt_pages = -(-prompt_len // bs)  # the partly filled last page is shared too (forks start new pages)
    gen_pages = -(-8 // bs)  # each sample writes < 8 tokens of its own, from a fresh page
    # four forks hold the prompt's pages once: exactly its pages plus each sample's own
    # (block-table entries, 4 bytes, are per request: every sample's table lists the shared pages)
    assert peak4 <= ((prompt_pages + 4 * gen_pages) * page + 4 * 4 * (prompt_pages + gen_pages)) * layers
    # four independent requests hold the prompt four times
    assert peak_sep >= 4 * (prompt_len // bs) * page * layers and peak4 < 0.5 * peak_sep
    assert peak1 < peak4 < 2 * peak1
    for c in (core1, core4, core_sep):
        assert c.cache.pages_in_use() == 0 and not c.cache.seqs and len(c.cache.refs) == 0
    # the per-request stats count a shared page in every request's view and say how much of it is shared
    res = forked.result
    assert res.stats["kv_bytes_shared"] > 0
    # sampled continuations differ between samples (own generators) but are reproducible
    again = e.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, n=4))
    assert [r.token_ids for r in again] == [r.token_ids for r in [forked.result, *[c.result for c in forked.forks]]]


def test_parent_freed_before_children_keeps_shared_pages(tiny_full):
    from trtkv.runtime.forking import fork_request
    from trtkv.runtime.sampling import make_generator

    e = tiny_full
    alone = e.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    core = e.make_core()
    parent = e.make_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    core.prefill(parent)
    for _ in range(3):
        core.decode_step([parent])
    child = fork_request(core, parent, SamplingParams(max_tokens=8, ignore_eos=True), make_generator(0))
    shared = len(core.cache.refs)
    assert shared > 0
    core.finish(parent)  # the parent goes first
    assert parent.req_id not in core.cache.seqs and core.cache.pages_in_use() > 0
    while not child.finished:
        core.decode_step([child])
    assert parent.generated[:3] + child.generated == alone.token_ids[:3 + len(child.generated)]
    core.finish(child)
    assert core.cache.pages_in_use() == 0 and len(core.cache.refs) == 0


def test_cow_eviction_copies_a_shared_page(tiny_full):
    from trtkv.runtime.forking import fork_request
    from trtkv.runtime.sampling import make_generator

    e = tiny_full
    core = e.make_core()
    parent = e.make_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    core.prefill(parent)
    child = fork_request(core, parent, SamplingParams(max_tokens=8, ignore_eos=True), make_generator(0))
    before = core.cache.pages_in_use()
    child.ctx.evict_all_layers([1, 2])
    assert core.cache.cow_copies == core.arch.num_hidden_layers
    assert core.cache.pages_in_use() == before + core.arch.num_hidden_layers
    assert 1 in set(parent.ctx.live_positions(0)) and 1 not in set(child.ctx.live_positions(0))
    core.finish(child)
    core.finish(parent)
    assert core.cache.pages_in_use() == 0


def test_tree_eviction_acts_on_every_sharer(tiny_full):
    from trtkv.runtime.forking import fork_request
    from trtkv.runtime.sampling import make_generator

    e = tiny_full
    core = e.make_core()
    parent = e.make_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    core.prefill(parent)
    kids = [fork_request(core, parent, SamplingParams(max_tokens=8, ignore_eos=True), make_generator(i), "tree")
            for i in range(2)]
    before = core.cache.pages_in_use()
    bs = core.cache.cfg.block_size
    parent.ctx.evict_all_layers(list(range(bs)))  # the whole first page
    assert core.cache.cow_copies == 0
    assert core.cache.pages_in_use() == before - core.arch.num_hidden_layers
    for r in (parent, *kids):
        assert min(r.ctx.live_positions(0)) == bs
    for r in (*kids, parent):
        core.finish(r)
    assert core.cache.pages_in_use() == 0 and len(core.cache.refs) == 0
