"""ThinKV: the paper's Figure 6 walkthrough, spec §9 properties, and equivalence to `full`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trtkv.api import SamplingParams
from trtkv.build.calibration import CalibrationArtifact
from trtkv.policies import make_policy
from trtkv.policies.thinkv import E, R, T, ThinKVPolicy, parse_precision


def run_engine(eng, prompt_ids: list[int], n: int, policy=None):
    """Generate n tokens from fixed prompt ids, returning (request, per-step snapshots of layer 0)."""
    if policy is not None:
        eng.core.policy = eng.policy = policy
    req = eng.make_request("x", SamplingParams(max_tokens=n, ignore_eos=True, chat=False))
    req.prompt_ids = list(prompt_ids)
    eng.scheduler.add(req)
    snaps = []
    while req.result is None:
        eng.scheduler.step()
        if req.ctx is not None and req.result is None:
            snaps.append(snapshot(eng, req))
    return req, snaps


def snapshot(eng, req):
    seq = req.ctx.seq
    t = seq.layers[0]
    return {"step": req.ctx.step, "pages": {k: list(v) for k, v in t.pages.items()},
            "loc": dict(t.loc), "live": [x.live for x in seq.layers]}


def test_parse_precision():
    assert parse_precision("R4E4T2") == {R: "nvfp4", E: "nvfp4", T: "ternary"}
    assert parse_precision("R8E4T2")[R] == "fp8"
    assert parse_precision("R4oE4oT2o") == {R: "nvfp4o", E: "nvfp4o", T: "ternaryo"}
    with pytest.raises(ValueError):
        parse_precision("R4E4")


def test_precision_grammar_covers_the_format_library():
    from plugins.formats import FORMATS
    from trtkv.policies.thinkv import format_precision

    assert parse_precision("R16E16T16") == {R: "fp16", E: "fp16", T: "fp16"}
    assert parse_precision("R4iE4iT2i") == parse_precision("R4aE4aT2a") == {R: "int4", E: "int4", T: "int2"}
    assert parse_precision("t2r4e4") == parse_precision("R4E4T2")  # any order, any case
    assert parse_precision("R:int4, E:nvfp4o, T:ternaryo") == {R: "int4", E: "nvfp4o", T: "ternaryo"}
    for fmt in FORMATS:  # every storage format has a code, and the compact string round-trips
        same = {R: fmt, E: fmt, T: fmt}
        assert parse_precision(format_precision(same)) == same


@pytest.mark.parametrize("bad", ["R4E4", "R4E4T2X", "R5E4T2", "R4R4T2", "R4E4T2E4", "R:int3,E:int4,T:int2",
                                 "", "4 4 2", "R4-E4-T2", "auto4"])
def test_precision_grammar_rejects_bad_strings_in_one_line(bad):
    from trtkv.errors import TrtkvError
    from trtkv.policies import make_policy

    with pytest.raises(TrtkvError) as e:
        make_policy("thinkv", {"precision": bad})
    msg = str(e.value)
    assert "\n" not in msg and "precision" in msg and "R4aE4aT2a" in msg, msg


def test_precision_auto_is_resolved_at_build_time():
    from trtkv.errors import TrtkvError
    from trtkv.policies import make_policy

    pol = make_policy("thinkv", {"precision": "auto"})
    assert pol.precision_is_auto()
    with pytest.raises(TrtkvError, match="trtkv build"):
        pol.formats()
    pol.set_precision("R:int4,E:int4,T:int2")
    assert pol.precision == "R4aE4aT2a"
    assert pol.formats() == {"int4"}  # uncalibrated: every segment is R, T's format is never written
    pol.thresholds, pol.thought_types = (0.4, 0.8), 3  # calibrated, three thought types: labels by sparsity
    assert pol.formats() == {"int4", "int2"}
    pol.thought_types = 1  # one type (paper §E.10): all R again
    assert pol.formats() == {"int4"} == pol.pool_formats()


def test_classify_boundaries():
    p = ThinKVPolicy(thresholds=(0.4, 0.8))
    assert p.classify(0.8) == T and p.classify(0.4) == R and p.classify(np.nextafter(0.4, 0)) == E
    with pytest.raises(ValueError):
        ThinKVPolicy(thresholds=(0.8, 0.4))


def walkthrough_engine(engine_factory, load_engine, tiny_ckpt):
    return load_engine(engine_factory(tiny_ckpt, "thinkv", block_size=4, tau=4, group=4, retention="2",
                                      precision="R16E16T16", thought_schedule="RETR", budget="none"))


def test_figure6_walkthrough(engine_factory, load_engine, tiny_ckpt):
    """tau = g = B = 4, retention {2}, labels R E T R on decode tokens A..P (spec §9.22)."""
    eng = walkthrough_engine(engine_factory, load_engine, tiny_ckpt)
    P = 8  # prompt fills exactly two pages
    req, snaps = run_engine(eng, list(range(100, 100 + P)), 19)
    by_step = {s["step"]: s for s in snaps}
    pos = lambda i: P + i  # noqa: E731  decode token i (A=0 ... P=15)
    # after the step that wrote L (i=11) nothing was evicted
    s11 = by_step[12]
    assert all(pos(i) in s11["loc"] for i in range(12))
    # at i=12 (end of the T segment I..L) A..D and E..H keep 2 tokens each; I..L untouched
    s12 = by_step[13]
    kept_ad = [i for i in range(0, 4) if pos(i) in s12["loc"]]
    kept_eh = [i for i in range(4, 8) if pos(i) in s12["loc"]]
    assert len(kept_ad) == 2 and len(kept_eh) == 2
    assert all(pos(i) in s12["loc"] for i in range(8, 12))
    # the R page of A..D: M and N (flushed at i=15) reuse its two freed slots; O and P take one new page
    r_cls = ("fp16", R)
    ad_page = s11["loc"][pos(0)][1]
    freed = {s11["loc"][pos(i)][2] for i in range(4) if i not in kept_ad}
    s15 = by_step[16]
    assert {s15["loc"][pos(12)][1], s15["loc"][pos(13)][1]} == {ad_page}
    assert {s15["loc"][pos(12)][2], s15["loc"][pos(13)][2]} == freed
    new_pages = set(s15["pages"][r_cls]) - set(s12["pages"][r_cls])
    assert len(new_pages) == 1 and {s15["loc"][pos(14)][1], s15["loc"][pos(15)][1]} == new_pages
    # the E page's freed slots stay free (same-type reuse only)
    e_page = s11["loc"][pos(4)][1]
    assert sum(1 for f, p, _ in s15["loc"].values() if p == e_page and f == "fp16"
               and e_page in s15["pages"][("fp16", E)]) == 2
    assert all(s15["loc"][pos(i)][1] != e_page for i in range(12, 16))
    assert eng.core.cache.pages_in_use() == 0


def test_labels_constant_within_segment_and_layers_equal(engine_factory, load_engine, tiny_ckpt):
    """§9.5 and §9.14: one label per tau-token segment (one page type, one format); live counts and
    levels equal across layers after every step; prompt never evicted."""
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", tau=16, group=16, budget=48, retention="8,4",
                                     thought_schedule="RTETRRTE"))
    P = 24
    req, snaps = run_engine(eng, list(range(200, 200 + P)), 160)
    for s in snaps:
        assert len(set(s["live"])) == 1
        assert all(p in s["loc"] for p in range(P))
    last = snaps[-1]
    pool_class = {}
    for pos, (fmt, page, slot) in last["loc"].items():
        if pos < P:
            continue
        seg = (pos - P) // 16
        label = "RTETRRTE"[seg % 8]
        want = {"R": R, "E": E, "T": T}[label]
        cls = next(c for c, pages in last["pages"].items() if page in pages and c[0] == fmt)
        assert cls[1] == want
        pool_class[page] = cls
    stats = req.result.stats["thinkv"]
    assert stats["labels"] == "RTETRRTERT"[: stats["segments"]]


def test_budget_case2_and_retention(engine_factory, load_engine, tiny_ckpt):
    """§9.10/§9.12: after each step live decode tokens <= k unless every closed segment is at the minimum;
    a segment's live count is min(tau, RET[n-1]) after its n-th selection and never below the minimum."""
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", tau=16, group=16, budget=40, retention="8,4",
                                     thought_schedule="RRRRRRRR"))
    P = 16
    req, snaps = run_engine(eng, list(range(300, 300 + P)), 200)
    pol = eng.core.policy
    for s in snaps:
        decode_live = len([p for p in s["loc"] if p >= P])
        segs_closed = s["step"] // 16
        assert decode_live <= max(40, 4 * segs_closed + 16) + 16
    assert req.result.stats["thinkv"]["live_decode_tokens"] <= max(40, 4 * (200 // 16))
    assert isinstance(pol, ThinKVPolicy)


def test_evict_is_metadata_only(engine_factory, load_engine, tiny_ckpt):
    """§9.16: code and scale pools are unchanged by an eviction."""
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", tau=16, group=16, budget=24, retention="8,4",
                                     thought_schedule="RRRR"))
    cache = eng.core.cache
    req = eng.make_request("x", SamplingParams(max_tokens=80, ignore_eos=True, chat=False))
    req.prompt_ids = list(range(400, 416))
    eng.scheduler.add(req)
    seen_evict = False
    while req.result is None:
        before = [[t.clone() for t in pool.fields] for pools in cache.pools for pool in pools.values()]
        ev_before = cache.evictions_total
        pol = eng.core.policy
        ops_pending = False
        eng.scheduler.step()
        if cache.evictions_total > ev_before and req.result is None and req.ctx.seq.buffered(0) != 0:
            seen_evict = True
            after = [[t for t in pool.fields] for pools in cache.pools for pool in pools.values()]
            for b, a in zip(before, after):
                for x, y in zip(b, a):
                    assert torch.equal(x, y)
        del ops_pending, pol
    assert seen_evict


@pytest.mark.model
def test_16bit_large_budget_matches_full(engine_factory, load_engine):
    """With budget >= length and 16-bit storage for every type, output equals `full` with fp16 storage."""
    full = load_engine(engine_factory("smollm2-135m", "full", kv_format="fp16"))
    thinkv = load_engine(engine_factory("smollm2-135m", "thinkv", budget=4096, precision="R16E16T16",
                                        thought_schedule="RET"))  # replayed labels: no calibration run
    prompt = "Explain why the sky is blue, step by step."
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    a = full.generate(prompt, params)[0]
    b = thinkv.generate(prompt, params)[0]
    assert a.token_ids == b.token_ids
    assert b.stats["evicted_tokens"] == 0


def test_make_policy_rejects_bad_values():
    from trtkv.errors import TrtkvError

    with pytest.raises(TrtkvError):
        make_policy("thinkv", {"tau": "100", "group": "16"})
    with pytest.raises(TrtkvError):
        make_policy("thinkv", {"thought_schedule": "RXZ"})
    with pytest.raises(TrtkvError):
        make_policy("thinkv", {"_formats": "x"})


def test_one_thought_type_labels_everything_r(engine_factory, load_engine, tiny_ckpt):
    """thought_types=1 (paper §E.10): no sparsity is requested, every segment is R, so no transition
    anneals; the budget still evicts (case 2) and the calibration's choice is taken unless overridden."""
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", budget=24, tau=8, group=4, retention="4",
                                     thought_types=1, thresholds="0.1,0.2", layers="0"))
    pol = eng.core.policy
    res = eng.generate("Numbers: 1, 2, 3", SamplingParams(max_tokens=60, ignore_eos=True, chat=False))[0]
    st = res.stats["thinkv"]
    assert set(st["labels"]) == {"R"} and st["thought_types"] == 1
    assert st["thought_shares"]["R"] == 1.0 and st["transition_anneals"] == 0
    assert res.stats["evicted_tokens"] > 0 and st["live_decode_tokens"] <= max(24, 4 * st["segments"])
    assert pol.stats_request(None, "decode") is None
    fresh = ThinKVPolicy()
    art = CalibrationArtifact(model="m", layers=(1,), thresholds=(0.4, 0.8), rule="kde-valleys", thought_types=1)
    fresh.load_calibration(art)
    assert fresh.thought_types == 1 and fresh.stats_request(None, "decode") is None
    mine = ThinKVPolicy(thought_types=3)
    mine.load_calibration(art)
    assert mine.thought_types == 3  # an explicit --set wins over the calibration


def _run_recording(eng, prompts: list[list[int]], params: SamplingParams, record) -> tuple[list, list]:
    """Run ``prompts`` to the end: their tokens, and ``record(request)`` of the running requests after each step."""
    reqs = []
    for ids in prompts:
        req = eng.make_request("x", params)
        req.prompt_ids = list(ids)
        eng.scheduler.add(req)
        reqs.append(req)
    seen = []
    while any(r.result is None for r in reqs):
        eng.scheduler.step()
        seen.append([record(r) for r in reqs if r.result is None])
    return [r.generated for r in reqs], seen


def test_chained_anneal_rounds_match_evicting_after_each_round(engine_factory, load_engine, tiny_ckpt):
    """A step whose segments are annealed twice (case 1, then case 2) runs its later rounds from the earlier rounds'
    survivors before evicting once (``thinkv_anneal.anneal_layer``): the same tokens and the same live positions in
    every layer of every request as evicting after each round."""
    from trtkv.policies import thinkv_anneal

    prompts = [list(range(300 + 7 * i, 316 + 7 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=120, ignore_eos=True, chat=False)

    def run(each_round: bool, seen: list):
        eng = load_engine(engine_factory(tiny_ckpt, "thinkv", tau=8, group=8, budget=24, retention="6,4,2",
                                         thought_schedule="RTTERTTERTTE"))
        original, less = thinkv_anneal.anneal_layer, thinkv_anneal._less_victims

        def per_round(layer, rounds, iters):
            for r in rounds:
                original(layer, [r], iters)  # (each round evicted before the next reads)

        def counted(*a):
            seen.append(1)
            return less(*a)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(thinkv_anneal, "_less_victims", counted)
            if each_round:
                m.setattr("trtkv.policies.thinkv.anneal_layer", per_round)
                m.setattr(ThinKVPolicy, "_select_ahead", lambda self, reqs, rounds: None)  # (layer by layer)
            return _run_recording(eng, prompts, params, lambda r: [sorted(t.loc) for t in r.ctx.seq.layers])

    chained, reference = [], []
    got, want = run(False, chained), run(True, reference)
    assert chained and not reference  # (a later round ran from the survivors of an earlier one)
    assert got == want


@pytest.mark.parametrize("settings", [{}, {"eviction": "compact"}])
def test_victims_selected_ahead_equal_layer_by_layer(engine_factory, load_engine, tiny_ckpt, settings):
    """A step's anneals select every layer's victims at its first layer when no job reaches a buffered position
    (``ThinKVPolicy._select_ahead``); each layer still evicts its own before its attention. The same tokens, live
    positions and their slots, bytes and peaks after every step as selecting layer by layer. A compacting cache moves
    a layer's tokens as it evicts (``RequestContext.reads_ahead``): its steps stay layer by layer."""
    from trtkv.policies import thinkv_anneal

    prompts = [list(range(300 + 7 * i, 316 + 7 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=120, ignore_eos=True, chat=False)

    def run(ahead: bool, calls: list):
        eng = load_engine(engine_factory(tiny_ckpt, "thinkv", tau=8, group=8, budget=24, retention="6,4,2",
                                         thought_schedule="RTTERTTERTTE", **settings))
        select = thinkv_anneal.select_victims

        def counted(rounds, iters, layer=None):
            calls.append(layer is None)
            return select(rounds, iters, layer)

        with pytest.MonkeyPatch.context() as m:
            m.setattr("trtkv.policies.thinkv.select_victims", counted)
            m.setattr(thinkv_anneal, "select_victims", counted)
            if not ahead:
                m.setattr(ThinKVPolicy, "_select_ahead", lambda self, reqs, rounds: None)
            return _run_recording(eng, prompts, params, lambda r: ([sorted(t.loc.items()) for t in r.ctx.seq.layers],
                                                                  r.ctx.seq.kv_bytes, r.ctx.seq.peak_bytes))

    ahead_calls, layer_calls = [], []
    got, want = run(True, ahead_calls), run(False, layer_calls)
    assert any(ahead_calls) != bool(settings) and not any(layer_calls) and layer_calls
    assert got == want


@pytest.mark.parametrize("buffered", [False, True])
def test_keys_of_jobs_in_several_layers_equal_layer_by_layer(engine_factory, load_engine, tiny_ckpt, buffered):
    """``RequestContext.keys_padded_layers`` (one lookup for every layer's jobs) returns, run by run, what
    ``keys_padded_flat`` returns in each layer — also when a job reaches a buffered token (then layer by layer)."""
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", tau=8, group=8, budget=None))
    params = SamplingParams(max_tokens=12, ignore_eos=True, chat=False)
    reqs = []
    for i in range(3):
        req = eng.make_request("x", params)
        req.prompt_ids = list(range(300 + 7 * i, 316 + 7 * i))
        eng.scheduler.add(req)
        reqs.append(req)
    for _ in range(5):  # (16 paged prompt tokens, 4 decode tokens in the buffers)
        eng.scheduler.step()
    ctxs = [r.ctx for r in reqs]
    L = ctxs[0].num_layers
    rng = np.random.default_rng(0)
    layers = np.repeat(np.arange(L), 2)
    which = rng.integers(0, 3, len(layers))
    jobs = [ctxs[j] for j in which.tolist()]
    top = 18 if buffered else 16
    picks = [np.sort(rng.choice(top, 5, replace=False)) for _ in layers]
    if buffered:
        picks[-1][-1] = 17
    positions, counts = np.concatenate(picks), np.full(len(layers), 5)
    got = ctxs[0].keys_padded_layers(layers, ctxs, which, positions, counts, 6)
    assert len(got) == L
    for layer, keys in enumerate(got):
        at = slice(10 * layer, 10 * layer + 10)
        want = ctxs[0].keys_padded_flat(layer, jobs[2 * layer:2 * layer + 2], positions[at], counts[:2], 6)
        assert torch.equal(keys, want)
