"""Preallocated KV pools and admission that never crashes or wedges (issues 13 and 19).

* The device pools are allocated once: no tensor or array of any pool is replaced, and no pool's capacity
  changes, during a long decode (full fp32, nvfp4 and int4 with key-scale arenas, ThinKV's formats, an
  evicting policy) — while the decode uses far more than the 8 pages the pools used to start with.
* A request that can never fit is refused at admission with one clear line, holds no page, and the next
  request runs; one that cannot fit *now* waits and then completes with the tokens it gets alone; a request
  that overflows a pool mid-run (its policy's bound was too low) fails alone, and the others finish.
* The same from the command line (``trtkv generate --set max_pages=`` / ``--kv-memory``) and from the
  OpenAI/KServe HTTP front end (a 400 for that request, the server keeps serving).
"""
from __future__ import annotations

import http.client
import json

import pytest
from policy_matrix import one_thread

from trtkv.api import Engine, SamplingParams
from trtkv.cache.budget import DEFAULT_CPU_KV_MEMORY, pages_needed
from trtkv.errors import OutOfKVMemory, TrtkvError
from trtkv.runtime.observers import EngineObserver
from trtkv.runtime.scheduler import Scheduler

assert one_thread
PROMPT = "Once upon a time, in a land far away, there lived a wise old king who loved puzzles and riddles."
LONG = " ".join(["The old king counted his riddles one by one and wrote each of them down."] * 12)
RAW = SamplingParams(max_tokens=40, ignore_eos=True, chat=False)


@pytest.fixture(scope="module")
def tiny(engine_factory, tiny_ckpt):
    """A fresh engine per call (the caps differ per test; no engine is shared with other modules)."""
    def get(name="full", cache=None, **params):
        return Engine.load(engine_factory(tiny_ckpt, name, **params), cache_overrides=cache)
    return get


def pool_identity(cache) -> dict:
    """Every buffer of every device pool, by address and size."""
    out = {}
    for layer, pools in enumerate(cache.pools):
        for fmt, p in pools.items():
            out[(layer, fmt)] = ([t.data_ptr() for t in (*p.fields, p.k_group, *p.group_fields)],
                                 [a.ctypes.data for a in (p.valid, p.live, p.hwm, p.slot_pos, p.slot_seg,
                                                          p.page_class, p.group_ref)],
                                 p.capacity, p.group_capacity)
    return out


def unchecked_request(eng, prompt, params, monkeypatch):
    """A request that skipped ``Engine.make_request``'s never-fit check (one built by other code)."""
    with monkeypatch.context() as m:
        m.setattr("trtkv.cache.admission.check_fits", lambda *a, **k: None)
        return eng.make_request(prompt, params)


def pool_readiness(cache) -> dict:
    """How many pages each device pool has initialised (and key-scale groups, where admission reserves them)."""
    return {(layer, fmt): (p.ready, p.groups_ready if cache.reserves_groups else None)
            for layer, pools in enumerate(cache.pools) for fmt, p in pools.items()}


class PoolWatch(EngineObserver):
    def __init__(self, cache):
        self.cache, self.before, self.steps = cache, pool_identity(cache), 0
        self.ready = None

    def on_prefill(self, req, logits, stats) -> None:
        self.ready = pool_readiness(self.cache)

    def on_step_end(self, reqs) -> None:
        assert pool_identity(self.cache) == self.before, "a KV pool was reallocated during decode"
        # admission readied the pages the requests reserved: no decode step initialises (first-touches) them
        assert pool_readiness(self.cache) == self.ready, "a decode step initialised pool pages"
        self.steps += 1


@pytest.mark.parametrize("name,params,arena", [
    ("full", {}, False),
    ("full", {"kv_format": "nvfp4"}, True),
    ("kivi", {"bits": 4}, True),
    ("thinkv", {"budget": 48, "tau": 16, "group": 16, "retention": "8,4", "thought_schedule": "RTER"}, True),
    ("h2o", {"budget": 24, "recent_ratio": 0.25, "evict_every": 4}, False),
], ids=["full", "full-nvfp4", "kivi-int4", "thinkv", "h2o"])
def test_pools_allocated_once_no_growth_during_decode(tiny, name, params, arena):
    eng = tiny(name, **params)
    cache = eng.core.cache
    assert not any(cache.pools), "pools are allocated on first use, not at load"
    cache.allocate()
    plan = cache.plan
    assert plan.budget == DEFAULT_CPU_KV_MEMORY and plan.device_bytes(cache.cfg) <= DEFAULT_CPU_KV_MEMORY
    assert sorted(cache.pools[0]) == sorted(eng.policy.pool_formats())
    watch = PoolWatch(cache)
    eng.core.attach(watch)
    try:
        res = eng.generate([PROMPT] * 3, SamplingParams(max_tokens=160, ignore_eos=True, chat=False))
    finally:
        eng.core.detach(watch)
    assert watch.steps >= 159 and all(len(r.token_ids) == 160 for r in res)
    assert pool_identity(cache) == watch.before
    peak = max(p.peak_in_use for pools in cache.pools for p in pools.values())
    assert peak > 8  # more than the old first allocation: the old pools would have grown here
    quantized = [p for pools in cache.pools for p in pools.values() if p.group_specs]
    if arena:  # key-scale groups were handed out from the preallocated arena
        assert quantized and max(p.peak_groups for p in quantized) > 0
    assert cache.pages_in_use() == 0 and all(p.groups_in_use == 0 for p in quantized)


def test_pool_budget_split_and_settings(tiny):
    from trtkv.cache.budget import page_cost, residual_bytes

    eng = tiny("thinkv", budget=48, tau=16, group=16, retention="8,4", thought_schedule="RTER",
               cache={"kv_memory": "4MiB"})
    cache, cfg = eng.core.cache, eng.core.cache.cfg
    fmts = sorted(eng.policy.pool_formats())
    assert len(fmts) > 1
    per_page = cfg.num_layers * sum(page_cost(f, cfg, True) for f in fmts)
    reserve = cfg.max_batch * residual_bytes(cfg)
    assert reserve == cfg.max_batch * 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 2  # fp16, g=16
    assert cache.plan.pages == int(((4 << 20) - reserve) // per_page)
    cache.allocate()
    assert {p.capacity for pools in cache.pools for p in pools.values()} == {cache.plan.pages}
    assert sum(p.allocated_bytes() for pools in cache.pools for p in pools.values()) <= 4 << 20
    for f in fmts:  # ThinKV drops tokens: one key-scale group per slot where the format has an arena
        pool = cache.pools[0][f]
        assert pool.group_capacity == (pool.capacity * cfg.block_size if pool.group_specs else 0)
    capped = tiny("full", cache={"max_pages": 12})
    assert capped.core.cache.plan.pages == 12 and capped.core.cache.plan.budget == 0
    with pytest.raises(TrtkvError, match="kv_memory_fraction"):
        tiny("full", cache={"kv_memory_fraction": "1.5"})
    assert tiny("full", cache={"kv_memory_fraction": "0.5"}).core.cache.cfg.kv_memory_fraction == 0.5
    with pytest.raises(OutOfKVMemory, match="cannot hold one page"):
        tiny("full", cache={"kv_memory": "1KiB"}).core.cache.plan


def test_default_budget_reserves_no_more_than_could_be_used(tiny):
    """The 2 GiB CPU default is address space a forking process pays for (a process whose reserved pools
    pass its RAM cannot fork): the default stops at max_batch requests at the model's full context."""
    from trtkv.cache.budget import useful_pages

    eng = tiny("full")
    cache, cfg = eng.core.cache, eng.core.cache.cfg
    ctx = eng.arch.max_position_embeddings
    want = cfg.max_batch * pages_needed(eng.policy, cfg, ctx - 1, 1)["fp32" if "fp32" in cache.formats else
                                                                      cache.formats[0]]
    assert cache.plan.pages == useful_pages(eng.policy, cfg, ctx) == want
    assert cache.plan.device_bytes(cfg) < DEFAULT_CPU_KV_MEMORY // 4
    explicit = tiny("full", cache={"kv_memory": "1GiB"}).core.cache  # an explicit budget is the user's
    assert explicit.plan.pages > cache.plan.pages


def test_never_fits_is_refused_at_admission_and_leaks_nothing(tiny, monkeypatch):
    probe = tiny("full")
    cap = max(pages_needed(probe.policy, probe.core.cache.cfg, len(probe.encode_prompt(PROMPT, False)), 40).values())
    eng = tiny("full", cache={"max_pages": cap})  # pools that hold PROMPT's request and not LONG's
    with pytest.raises(OutOfKVMemory) as e:
        eng.generate(LONG, RAW)
    msg = str(e.value)
    assert "can never fit" in msg and f"max_pages={cap}" in msg and "\n" not in msg
    assert eng.core.cache.pages_in_use() == 0 and not eng.core.cache.seqs
    with pytest.raises(OutOfKVMemory, match="can never fit"):  # the server path refuses at submit
        eng.submit(LONG, RAW)
    assert len(eng.generate(PROMPT, RAW)[0].token_ids) == 40  # the next request runs
    assert len(eng.submit(PROMPT, RAW).result().token_ids) == 40
    eng.shutdown()
    # a request that reached the scheduler some other way is failed there, not run and not left waiting
    big = unchecked_request(eng, LONG, RAW, monkeypatch)
    ok = eng.make_request(PROMPT, RAW)
    sched = Scheduler(eng.core, 8)
    sched.add(big)
    sched.add(ok)
    done = []
    while sched.has_work:
        done += sched.step()
    assert big.finish_reason == "error" and "can never fit" in big.error and big.result is not None
    assert ok.finish_reason == "length" and eng.core.cache.pages_in_use() == 0


def test_request_that_does_not_fit_now_waits_then_completes(tiny):
    alone = tiny("full").generate(PROMPT, RAW)[0].token_ids
    eng = tiny("full")
    P = len(eng.encode_prompt(PROMPT, False))
    need = pages_needed(eng.policy, eng.core.cache.cfg, P, 40)["fp32"]
    eng = tiny("full", cache={"max_pages": need + need // 2})  # one at a time
    sched = eng.scheduler
    reqs = [eng.make_request(PROMPT, RAW) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    sched.step()
    assert len(sched.running) == 1 and len(sched.waiting) == 2
    most = 1
    while sched.has_work:
        sched.step()
        most = max(most, len(sched.running))
    assert most == 1
    assert [r.result.token_ids for r in reqs] == [alone] * 3
    assert eng.core.cache.pages_in_use() == 0
    # the public API: a batch bigger than the pools finishes, one request at a time
    assert [r.token_ids for r in eng.generate([PROMPT] * 3, RAW)] == [alone] * 3


def test_overflow_mid_run_fails_only_that_request(tiny, monkeypatch):
    """A request whose reservation understated its pages (here: set by hand, as a policy with too low a bound
    would) fills the pool; it fails with the pool's line and frees its pages — whichever request asked for
    the page — the other request's half-done step is undone and rerun, and it finishes with exactly the
    tokens it gets alone."""
    long_raw = SamplingParams(max_tokens=120, ignore_eos=True, chat=False)
    alone = tiny("full").generate(PROMPT, long_raw)[0].token_ids
    eng = tiny("full")
    P = len(eng.encode_prompt(PROMPT, False))
    need = pages_needed(eng.policy, eng.core.cache.cfg, P, 120)["fp32"]
    eng = tiny("full", cache={"max_pages": need + 2})
    for when, liar_prompt in (("decode", PROMPT), ("prefill", LONG), ("decode, liar first", PROMPT)):
        good = eng.make_request(PROMPT, long_raw)
        liar = unchecked_request(eng, liar_prompt, long_raw, monkeypatch)
        liar.kv_pages = {"fp32": 1}  # admission believes it needs one page
        sched = eng.scheduler
        for r in ((liar, good) if "first" in when else (good, liar)):
            sched.add(r)
        sched.step()
        assert len(sched.running) == (1 if when == "prefill" else 2), when
        while sched.has_work:
            sched.step()
        assert liar.finish_reason == "error" and "KV pool is full" in liar.error, when
        assert liar.result.finish_reason == "error"
        assert good.finish_reason == "length" and good.result.token_ids == alone, when
        assert eng.core.cache.pages_in_use() == 0 and not eng.core.cache.seqs
    # the API surfaces the failed request's line; the engine keeps serving
    liar = eng.make_request(PROMPT, long_raw)
    liar.kv_pages = {"fp32": 1}
    good = eng.make_request(PROMPT, long_raw)
    handles = [eng._enqueue(good), eng._enqueue(liar)]
    eng.start_background()
    assert handles[0].result().token_ids == alone
    with pytest.raises(TrtkvError, match="KV pool is full"):
        handles[1].result()
    assert len(eng.submit(PROMPT, RAW).result().token_ids) == 40
    eng.shutdown()
    assert eng.core.cache.pages_in_use() == 0


@pytest.mark.parametrize("cap", [["--set", "max_pages=8"], ["--kv-memory", "64KiB"]], ids=["max_pages", "kv_memory"])
def test_cli_capped_engine_long_prompt_one_line_exit_2(tiny_ckpt, engine_factory, cap):
    from click.testing import CliRunner

    from trtkv.cli import main

    path = engine_factory(tiny_ckpt, "full")
    r = CliRunner().invoke(main, ["generate", str(path), "--prompt", LONG, "--raw", "--max-tokens", "16", *cap])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trtkv: error:") and "can never fit" in lines[0]
    assert "Traceback" not in r.output
    r = CliRunner().invoke(main, ["generate", str(path), "--prompt", "hi", "--raw", "--max-tokens", "4", *cap])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["generate", str(path), "--prompt", "hi", "--set", "max_pages=0"])
    assert r.exit_code == 2 and r.output.count("trtkv: error:") == 1 and "max_pages" in r.output


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_http_front_end_capped_engine_400_and_keeps_serving(tiny):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from trtkv.serve.http_front import HttpFrontEnd

    eng = tiny("full", cache={"max_pages": 8})
    front = HttpFrontEnd(eng, SamplingParams, host="127.0.0.1", port=0).start()
    try:
        status, body = _post(front.port, "/v1/completions", {"model": "trtkv", "prompt": LONG, "max_tokens": 8})
        assert status == 400 and "can never fit" in body["error"]["message"], body
        status, body = _post(front.port, "/v2/models/trtkv/generate", {"text_input": LONG, "max_tokens": 8})
        assert status == 400 and "can never fit" in body["error"], body
        status, body = _post(front.port, "/v1/completions", {"model": "trtkv", "prompt": "hi", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        assert eng.metrics()["live_pages"] == 0
    finally:
        front.stop()
        eng.shutdown()


def test_page_pool_is_fixed_and_says_when_full():
    from plugins.formats import get_format

    from trtkv.cache.pool import PagePool

    pool = PagePool(get_format("int4"), 2, 16, 4, "cpu", pages=3, groups=2)
    ptrs = [t.data_ptr() for t in (*pool.fields, pool.k_group, *pool.group_fields)]
    pages = [pool.alloc_page(0) for _ in range(3)]
    assert pages == [0, 1, 2] and pool.free_pages == 0
    assert int(pool.k_group[:3].min()) == -1 and not any(bool(t[:3].any()) for t in pool.fields)
    with pytest.raises(OutOfKVMemory, match="int4 KV pool is full"):
        pool.alloc_page(0)
    pool.release_page(1)
    assert pool.alloc_page(0) == 1  # the lowest free page first
    assert [pool.alloc_group(1) for _ in range(2)] == [0, 1]
    with pytest.raises(OutOfKVMemory, match="key-scale arena is full"):
        pool.alloc_group(1)
    assert pool.decref_group(0) and pool.alloc_group(1) == 0
    assert [t.data_ptr() for t in (*pool.fields, pool.k_group, *pool.group_fields)] == ptrs
    assert (pool.capacity, pool.group_capacity, pool.peak_in_use, pool.peak_groups) == (3, 2, 3, 2)
    host = PagePool(get_format("int4"), 2, 16, 4, "cpu", pages=2, groups=2, growable=True)  # host tiers still grow (host memory only)
    assert [host.alloc_page(0) for _ in range(5)] == [0, 1, 2, 3, 4] and host.capacity == 8
    assert [host.alloc_group(1) for _ in range(3)] == [0, 1, 2] and host.group_capacity >= 3


def test_residual_arena_has_max_batch_rows_and_admission_never_grows_it(tiny):
    """The residual buffers' bytes are set aside for max_batch requests by the budget; the arena holds
    that many rows from the start, so admitting a full batch never reallocates it."""
    eng = tiny("kivi", bits=4, cache={"max_batch": 12})
    arena = eng.core.cache.residual
    assert arena is not None and arena.k.shape[0] == 12
    before = (arena.k.data_ptr(), arena.v.data_ptr())
    res = eng.generate([f"{PROMPT} ({i})" for i in range(12)], SamplingParams(max_tokens=24, ignore_eos=True,
                                                                             chat=False))
    assert all(len(r.token_ids) == 24 for r in res)
    assert (arena.k.data_ptr(), arena.v.data_ptr()) == before and arena.k.shape[0] == 12
    assert sorted(arena.free) == list(range(12))  # every row came back


THINKV_TIGHT = {"budget": 24, "tau": 16, "group": 16, "retention": "4", "thought_schedule": "TRET"}


def test_key_group_reservation_admits_more_and_never_overflows_the_arena(tiny):
    """Arenas sized for the workload (``key_groups_per_page``, what ``trtkv bench --requests`` sets): admission
    reserves groups besides pages, a larger batch fits the same memory than with one group per slot, and a
    queue of evicting ThinKV requests (many anneals: live groups thinned towards one token each) all finish
    with no arena overflow; arenas too sparse for a request refuse it with one line naming the groups."""
    import dataclasses

    from trtkv.bench.capacity import largest_batch
    from trtkv.cache.budget import groups_needed, plan_pools
    from trtkv.runtime.request import Request
    from trtkv.runtime.sampling import make_generator

    eng = tiny("thinkv", **THINKV_TIGHT)
    P, G = 12, 96
    cfg = dataclasses.replace(eng.core.cache.cfg, kv_memory=160 * 1024)
    cap = largest_batch(eng.policy, cfg, P, G)
    assert cap.batch > 1 and cap.key_groups_per_page is not None and cap.key_groups_per_page < cfg.block_size
    plain = plan_pools(dataclasses.replace(cfg, max_batch=cap.batch), eng.policy.pool_formats(), True)
    assert plain.pages < cap.pool_pages  # one group per slot: fewer pages in the same memory
    core = eng.make_core(kv_memory=cfg.kv_memory, max_batch=cap.batch, key_groups_per_page=cap.key_groups_per_page)
    assert core.cache.reserves_groups
    sched = Scheduler(core, cap.batch)
    params = SamplingParams(max_tokens=G, ignore_eos=True, chat=False).validate(2048)
    reqs = [Request(9000 + i, "", [(7 * i + j) % 500 + 3 for j in range(P)], params, make_generator(i), 2048)
            for i in range(2 * cap.batch)]
    for r in reqs:
        sched.add(r)
    most, reserved_ok = 0, True
    while sched.has_work:
        sched.step()
        most = max(most, len(sched.running))
        free = sched.free_groups()
        reserved_ok &= all(n >= 0 for n in free.values())
    assert all(r.finish_reason == "length" and len(r.generated) == G for r in reqs), [r.error for r in reqs]
    assert most == cap.batch and reserved_ok
    need = groups_needed(eng.policy, core.cache.cfg, P, G)
    for pools in core.cache.pools:
        for fmt, pool in pools.items():
            assert pool.peak_groups <= cap.batch * need[fmt] <= pool.group_capacity
    # arenas too sparse for one request's groups: refused at admission, not overflowed mid-run
    sparse = eng.make_core(kv_memory=cfg.kv_memory, max_batch=cap.batch, key_groups_per_page=0.05)
    s2 = Scheduler(sparse, cap.batch)
    r = Request(9999, "", list(range(3, 3 + P)), params, make_generator(0), 2048)
    s2.add(r)
    while s2.has_work:
        s2.step()
    assert r.finish_reason == "error" and "can never fit" in r.error and "key-scale groups" in r.error


def test_a_batch_of_1024_requests_runs_and_admission_keeps_its_counts(tiny):
    """The scheduler at scale: 1,100 queued requests, at most 1,024 at once (admission by memory, counters
    of what the running requests reserve kept as they start and stop), every request finishes with its
    tokens, and the counters agree with a recount over the running set at every step."""
    from trtkv.runtime.request import Request
    from trtkv.runtime.sampling import make_generator

    eng = tiny("h2o", budget=16, cache={"max_batch": 1024, "kv_memory": "64MiB"})
    core = eng.core
    sched = Scheduler(core, 1024)
    params = SamplingParams(max_tokens=6, ignore_eos=True, chat=False).validate(2048)
    reqs = [Request(20000 + i, "", [(11 * i + j) % 500 + 3 for j in range(8)], params, make_generator(i), 2048)
            for i in range(1100)]
    for r in reqs:
        sched.add(r)
    most = 0
    while sched.has_work:
        sched.step()
        most = max(most, len(sched.running))
        recount = {f: core.cache.capacity_pages(f) - sum(sched.reserved_pages(r).get(f, 0) for r in sched.running)
                   for f in core.policy.formats()}
        assert sched.free_pages() == recount
    assert most == 1024
    assert all(r.finish_reason == "length" and len(r.generated) == 6 for r in reqs)
    assert core.cache.pages_in_use() == 0 and not core.cache.seqs
