"""AMS: the testable properties of shared/specs/ams.md §7 (numbers in the test names). Selection invariants
are randomised over T, T_keep, scores and masses; engine properties run on the tiny random Llama.

Not applicable in trtkv: the spec's per-(layer, KV head) keep sets (trtkv's cache evicts per layer, so the
policy averages masses and scores over KV heads: one keep set per layer) and shared prefix blocks (13/15).
Property 13 (paged == dense after compaction) is implied by 14, which compares every step's logits."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from policy_matrix import Probe, masked_reference_logits, one_thread

from trtkv.api import SamplingParams
from trtkv.models.rope import apply_rotary, inverse_frequencies
from trtkv.policies import make_policy
from trtkv.policies.ams import (allocate, ams_select, ea_log_expectation, expected_attention_scores, keydiff_scores,
                                must_keep, rkv_scores, rope_average, segment, select, tova_scores, unrotate,
                                usage, window_rows)
from trtkv.policies.ams_selection_rows import ams_keep_rows
from trtkv.policies.scoring import cosine_redundancy, normalize_mass

assert one_thread  # autouse: one intra-op thread for this module

PROMPT = "Once upon a time, in a land far away, there lived a wise old king who loved puzzles and riddles."
OTHER = "The quick brown fox jumps over the lazy dog."
SP = SamplingParams(max_tokens=90, ignore_eos=True, chat=False)
BASE = {"budget": 24, "interval": 8, "hs": 8, "window": 4, "l_min": 4, "l_max": 16}
CFG = dict(delta=0.1, l_min=16, l_max=256, q_min=1, n_sink=4, n_last=32)


def rand_case(rng, T=None, T_keep=None):
    T = T or int(rng.integers(2, 600))
    T_keep = T_keep or int(rng.integers(1, T))
    mu = rng.gamma(0.3, 1.0, T) * (rng.random(T) < 0.7)
    g = rng.normal(size=T)
    return T, T_keep, mu, g


def segments_of(mu, cfg):
    return segment(mu / mu.sum(), cfg["delta"], cfg["l_min"], cfg["l_max"])


# --- 1-5: selection invariants --------------------------------------------------------------------------
def test_1_identity_when_under_budget():
    rng = np.random.default_rng(0)
    for _ in range(50):
        T = int(rng.integers(1, 100))
        keep, _ = ams_select(rng.random(T), rng.normal(size=T), T + int(rng.integers(0, 5)), **CFG)
        assert keep.tolist() == list(range(T))


@pytest.mark.parametrize("mode", ["reserve", "reference"])
def test_2_exactly_t_keep_unique_sorted(mode):
    rng = np.random.default_rng(1)
    for _ in range(300):
        T, T_keep, mu, g = rand_case(rng)
        cfg = dict(CFG, delta=float(rng.choice([0.02, 0.1, 0.3])), l_min=int(rng.integers(1, 40)),
                   l_max=int(rng.integers(40, 300)), q_min=int(rng.integers(0, 10)),
                   n_sink=int(rng.integers(0, 8)), n_last=int(rng.integers(0, 64)))
        keep, info = ams_select(mu, g, T_keep, mode=mode, **cfg)
        assert len(keep) == T_keep and len(set(keep.tolist())) == T_keep
        assert (np.diff(keep) > 0).all() and keep.min() >= 0 and keep.max() < T
        if mode == "reserve":  # backfill never needed: quotas fill the budget exactly
            assert sum(info["quotas"]) == T_keep - len(info["must"])


def test_3_must_keep():
    rng = np.random.default_rng(2)
    for _ in range(200):
        T, T_keep, mu, g = rand_case(rng)
        n_sink, n_last = int(rng.integers(0, 8)), int(rng.integers(0, 64))
        for mode in ("reserve", "reference"):
            keep, info = ams_select(mu, g, T_keep, mode=mode, **dict(CFG, n_sink=n_sink, n_last=n_last))
            must = set(info["must"].tolist())
            assert must <= set(keep.tolist())
            if T_keep >= n_sink + n_last:
                assert must == set(range(n_sink)) | set(range(T - n_last, T))
            elif mode == "reserve":  # sinks whole, suffix shortened
                assert set(range(min(n_sink, T_keep))) <= must
                assert len(must) == min(T_keep, n_sink + n_last)
            else:  # reference: suffix whole, sinks shortened
                assert set(range(T - min(n_last, T_keep), T)) <= must


def test_4_quota_guarantee_reserve():
    rng = np.random.default_rng(3)
    for _ in range(300):
        T, T_keep, mu, g = rand_case(rng)
        q_min = int(rng.integers(0, 6))
        cfg = dict(CFG, q_min=q_min, l_min=int(rng.integers(1, 20)), l_max=int(rng.integers(20, 200)))
        keep, info = ams_select(mu, g, T_keep, **cfg)
        must = set(info["must"].tolist())
        kept = set(keep.tolist())
        segs, q = info["segments"], info["quotas"]
        total = T_keep - len(must)
        assert sum(q) == total
        caps = [sum(1 for j in range(a, b) if j not in must) for a, b in segs]
        if sum(min(q_min, c) for c in caps) <= total:
            for (a, b), qi, cap in zip(segs, q, caps):
                assert qi <= cap and qi >= min(q_min, cap)
                assert sum(1 for j in range(a, b) if j in kept and j not in must) == qi


def test_5_segments_partition_and_bounds():
    rng = np.random.default_rng(4)
    for _ in range(300):
        T = int(rng.integers(1, 2000))
        mu = rng.gamma(0.2, 1.0, T) + 1e-12
        mu /= mu.sum()
        delta = float(rng.choice([0.005, 0.02, 0.1, 0.25, 1.0]))
        l_min, l_max = int(rng.integers(1, 64)), int(rng.integers(64, 1024))
        segs = segment(mu, delta, l_min, l_max)
        assert segs[0][0] == 0 and segs[-1][1] == T
        assert all(a < b for a, b in segs) and all(segs[i][1] == segs[i + 1][0] for i in range(len(segs) - 1))
        assert all(b - a >= l_min for a, b in segs[:-1])
        assert all(b - a <= l_max + l_min - 1 for a, b in segs)
        assert len(segs) <= math.ceil(1 / delta - 1e-9) + math.ceil(T / l_max)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=hst.integers(0, 2 ** 31), k=hst.integers(1, 9), T=hst.integers(2, 400), keep=hst.floats(0.05, 1.1),
       delta=hst.sampled_from([0.02, 0.1, 0.3, 1.0]), l_min=hst.integers(1, 40), l_max=hst.integers(1, 300),
       q_min=hst.integers(0, 8), n_sink=hst.integers(0, 8), n_last=hst.integers(0, 40),
       ablation=hst.sampled_from(["none", "fixed_segments", "no_mass", "global_topk"]),
       mode=hst.sampled_from(["reserve", "reserve", "reference"]), ties=hst.booleans(), odd=hst.booleans(),
       f32=hst.sampled_from([None, "float32", "values"]))
def test_keep_rows_match_one_request_at_a_time(seed, k, T, keep, delta, l_min, l_max, q_min, n_sink, n_last, ablation,
                                               mode, ties, odd, f32):
    """``ams_keep_rows`` (every request's selection of a layer by array operations) keeps what ``ams_select`` keeps
    for each row: sparse and zero masses, tied scores, NaN and negative masses (the reference's path); scores that
    are float32 values (as float32, or as float64 holding them: the one-sort ranking), with -0, infinities and NaN."""
    rng = np.random.default_rng(seed)
    T_keep = max(1, int(T * keep))
    mu = rng.gamma(0.3, 1.0, (k, T)) * (rng.random((k, T)) < 0.7)
    g = rng.normal(size=(k, T))
    if ties:
        g = np.round(g, 1)
    if odd:
        mu[0] = 0.0
        mu[-1, rng.integers(0, T)] = -0.5 if k > 1 else np.nan
    if f32 is not None:
        g = g.astype(np.float32)
        if odd:  # (the ranking's edge cases: -0 ties +0, NaN after every number)
            g[rng.random(g.shape) < 0.2] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32))
        if f32 == "values":
            g = g.astype(np.float64)
    cfg = dict(delta=delta, l_min=l_min, l_max=l_max, q_min=q_min, n_sink=n_sink, n_last=n_last, mode=mode,
               ablation=ablation)
    mask = ams_keep_rows(mu, g, T_keep, **cfg)
    for j in range(k):
        assert np.flatnonzero(mask[j]).tolist() == ams_select(mu[j], g[j], T_keep, **cfg)[0].tolist()


# --- 6-7: mass and EMA credit (a fake request drives the policy's event code) ---------------------
class FakeReq:
    """The part of RequestContext AMS reads, over random post-RoPE K/V (one layer, no residual buffer)."""

    def __init__(self, T, H=2, Hq=4, D=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.H, self.Hq, self.D, self.gen = H, Hq, D, g
        self.num_layers = 1
        self.num_kv_heads = H
        self.eviction_mode = "compact"
        self.req_id, self.step, self.prompt_len = 0, 0, 0
        self.kvs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.state = None
        self.add(T)

    def add(self, n):
        start = max(self.kvs, default=-1) + 1
        for p in range(start, start + n):
            self.kvs[p] = (torch.randn(self.H, self.D, generator=self.gen),
                           torch.randn(self.H, self.D, generator=self.gen))
        self.position = start + n

    def live_positions(self, layer):
        return np.array(sorted(self.kvs), dtype=np.int64)

    def buffered_positions(self, layer):
        return np.zeros(0, np.int64)

    def all_positions(self, layer):
        return self.live_positions(layer)

    def num_live(self, layer):
        return len(self.kvs)

    def kv(self, layer, positions):
        return (torch.stack([self.kvs[int(p)][0] for p in positions]),
                torch.stack([self.kvs[int(p)][1] for p in positions]))

    def keys(self, layer, positions):
        return self.kv(layer, positions)[0]

    def evict(self, layer, positions):
        for p in positions:
            self.kvs.pop(int(p), None)
        return len(positions)

    def queries(self, n):
        return [(self.position - n + i, torch.randn(self.Hq, self.D, generator=self.gen)) for i in range(n)]


def event(pol, req, rec):
    pos = req.live_positions(0)
    keys, _ = req.kv(0, pos)
    w, rows, _ = pol.evidence(req, 0, pos, rec, keys, req.H)
    return pos, rows


def test_6_mass_is_a_distribution():
    for seed in range(5):
        req = FakeReq(200, seed=seed)
        for ablation in ("none", "no_credit"):
            pol = make_policy("ams", {"budget": 64, "interval": 32, "window": 16, "ablation": ablation})
            pol.begin(req)
            pos, rows = event(pol, req, req.queries(32))
            m_cur, m_used = pol.masses(req, 0, pos, rows, req.H)
            for m in (m_cur, m_used):
                assert (m >= 0).all() and abs(float(m.sum()) - 1) < 1e-6


def test_7_ema_credit():
    req = FakeReq(200)
    pol = make_policy("ams", {"budget": 64, "interval": 32, "window": 16})
    pol.begin(req)
    pos, rows = event(pol, req, req.queries(32))
    m_cur, m_used = pol.masses(req, 0, pos, rows, req.H)
    torch.testing.assert_close(m_used, m_cur, rtol=1e-5, atol=1e-9)  # first event: m_used == m_cur
    credit = req.state.credit
    keep = pol.select_layer(req, 0, pos, np.zeros(0, np.int64), req.queries(32), req.H)
    c1 = credit.get(0, pos).clone()  # after this event's update
    req.evict(0, np.setdiff1d(pos, pos[keep]))
    kept = req.live_positions(0)
    assert kept.tolist() == pos[keep].tolist()
    assert torch.equal(credit.get(0, kept), c1[keep])  # c' = c[I]: the credit travels with its token
    req.add(40)  # slots appended later read zero credit
    assert (credit.get(0, np.arange(200, 240)) == 0).all()
    # beta = 1: m_used == m_cur always
    pol1 = make_policy("ams", {"budget": 64, "interval": 32, "window": 16, "beta": 1.0})
    pol1.begin(req)
    for _ in range(3):
        pos3, rows3 = event(pol1, req, req.queries(32))
        a, b = pol1.masses(req, 0, pos3, rows3, req.H)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    # use_credit = False: no credit stored
    pol2 = make_policy("ams", {"budget": 64, "use_credit": False})
    pol2.begin(req)
    pos4, rows4 = event(pol2, req, req.queries(32))
    pol2.masses(req, 0, pos4, rows4, req.H)
    assert req.state.credit is None


def test_7_credit_update_rule():
    req = FakeReq(120, seed=3)
    pol = make_policy("ams", {"budget": 48, "interval": 16, "window": 8})
    pol.begin(req)
    pos, rows = event(pol, req, req.queries(16))
    m1, _ = pol.masses(req, 0, pos, rows, req.H)
    c1 = req.state.credit.get(0, pos).clone()
    torch.testing.assert_close(c1, (1 - pol.lam) * m1)
    m2, used2 = pol.masses(req, 0, pos, rows, req.H)
    c2 = req.state.credit.get(0, pos)
    torch.testing.assert_close(c2, pol.lam * c1 + (1 - pol.lam) * m2)
    want = normalize_mass(pol.beta * m2 + (1 - pol.beta) * normalize_mass(c2))
    torch.testing.assert_close(used2, want)


# --- 8-10: degenerate cases, scale invariance, anti-wipe-out ---------------------------------------
def test_8_one_segment_equals_global_topk():
    rng = np.random.default_rng(5)
    for _ in range(100):
        T, T_keep, mu, g = rand_case(rng)
        cfg = dict(CFG, delta=1.0, l_max=T + 1)
        a, info = ams_select(mu, g, T_keep, **cfg)
        b, _ = ams_select(mu, g, T_keep, ablation="global_topk", **cfg)
        assert len(info["segments"]) == 1 and a.tolist() == b.tolist()


def test_8_uniform_mass_even_segments():
    for T, delta in [(200, 0.1), (333, 0.05), (1000, 0.02)]:
        mu = np.full(T, 1.0 / T)
        segs = segment(mu, delta, 1, T)
        assert all(abs((b - a) - T * delta) <= 1 for a, b in segs[:-1])
        q = allocate(segs, mu, T // 2, must_keep(T, T // 2, 0, 0), 1)
        assert max(q) - min(q) <= 2


def test_9_scale_invariance():
    rng = np.random.default_rng(6)
    for _ in range(100):
        T, T_keep, mu, _ = rand_case(rng)
        g = rng.permutation(T).astype(float)  # distinct scores: no ties
        a, _ = ams_select(mu, g, T_keep, **CFG)
        b, _ = ams_select(mu, 3.5 * g - 7.0, T_keep, **CFG)
        assert a.tolist() == b.tolist()
        u = rng.random(T)
        assert segment(normalize_mass(torch.tensor(u)).numpy(), 0.1, 16, 256) == \
            segment(normalize_mass(torch.tensor(u * 17.0)).numpy(), 0.1, 16, 256)


def test_10_anti_wipe_out():
    T, T_keep = 1000, 128
    g = np.full(T, 1e-6)
    g[500:700] = 1.0  # one salient region
    mu = np.ones(T)
    glob, _ = ams_select(mu, g, T_keep, ablation="global_topk", **CFG)
    ams, info = ams_select(mu, g, T_keep, **dict(CFG, q_min=2))
    must = set(info["must"].tolist())
    empty_global = [s for s in info["segments"] if not any(a in glob for a in range(*s) if a not in must)]
    assert empty_global  # global top-k wipes out whole segments
    for a, b in info["segments"]:
        cap = sum(1 for j in range(a, b) if j not in must)
        assert sum(1 for j in ams if a <= j < b and j not in must) >= min(2, cap)


# --- 11: window evidence ------------------------------------------------------------------------------
def test_11_usage_pad_and_pool_edges():
    rows = torch.rand(3, 4, 20)  # [W, Hq, T]
    rows /= rows.sum(-1, keepdim=True)
    u = usage(rows, 2, 5, "max")
    a = rows.mean(0)
    nw = 17
    pooled = torch.nn.functional.avg_pool1d(a[:, :nw][:, None], 5, 1, 2, count_include_pad=True)[:, 0]
    want = pooled.view(2, 2, nw).mean(1)
    torch.testing.assert_close(u[:, :nw], want)
    assert (u[:, nw:] == want.max()).all()  # the pad is one scalar: the max over heads and slots
    assert torch.isclose(u[0, 0], (a[:2, :3].sum(-1) / 5).mean())  # zero-padded edge


def test_11_recomputed_rows_equal_kernel_rows(engine_factory, load_engine, tiny_ckpt):
    from trtkv.policies.base import StatsRequest
    from trtkv.runtime.observers import EngineObserver

    eng = load_engine(engine_factory(tiny_ckpt, "ams", **BASE))
    pol = eng.core.policy
    kernel_rows: dict[int, dict[int, tuple]] = {}  # step -> layer -> (positions, weights)
    checked = []
    H = eng.arch.num_key_value_heads

    class KernelRows(EngineObserver):
        def stats_request(self, phase):
            return StatsRequest(weights=True)

        def on_decode(self, reqs, logits, stats):  # the step about to end is decode step reqs[0].ctx.step + 1
            fs = stats[0]
            kernel_rows[reqs[0].ctx.step + 1] = {l: (ls.positions.copy(), ls.weights.clone())
                                                 for l, ls in fs.layers.items()}

    def check(req, layer, pos, w, rows):
        for i in range(w):
            step = req.step - w + 1 + i
            kp, kw = kernel_rows[step][layer]
            order = np.searchsorted(pos, kp)
            full = torch.zeros_like(rows[i])
            full[:, order] = kw
            torch.testing.assert_close(rows[i], full, rtol=0, atol=1e-6)
        checked.append((req.step, layer, w))

    def select_layer(req, layer, pos, buf, rec, H_):  # a request alone (e.g. residual-buffer tokens)
        keys, _ = req.kv(layer, pos)
        w, rows, _ = pol.evidence(req, layer, pos, rec, keys, H)
        check(req, layer, pos, w, rows)
        return type(pol).select_layer(pol, req, layer, pos, buf, rec, H_)

    def window_evidence(reqs, layer, pos, keys, queries):  # requests selected together
        w, rows = type(pol).window_evidence(pol, reqs, layer, pos, keys, queries)
        for j, req in enumerate(reqs):
            check(req, layer, pos[j], w, rows[j, -w:])
        return w, rows

    core = eng.make_core(observers=[KernelRows()])
    core.policy.select_layer = select_layer
    core.policy.window_evidence = window_evidence
    try:
        from trtkv.runtime.scheduler import Scheduler

        req = eng.make_request(PROMPT, SP)
        sched = Scheduler(core)
        sched.add(req)
        while sched.has_work:
            sched.step()
    finally:
        del core.policy.select_layer, core.policy.window_evidence
    assert checked and all(w == 4 for _, _, w in checked)


# --- 12, 14, 15, 16, 22, 23: the engine -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ams(engine_factory, load_engine, tiny_ckpt):
    def get(**params):
        return load_engine(engine_factory(tiny_ckpt, "ams", **{**BASE, **params}))
    return get


@contextlib.contextmanager
def around_events(eng, fn):
    pol = eng.core.policy

    def _events(reqs):
        before = [fn(req, "before") for req in reqs]
        type(pol)._events(pol, reqs)
        for req, b in zip(reqs, before):
            fn(req, "after", b)

    pol._events = _events
    try:
        yield
    finally:
        del pol._events


def test_12_15_gather_compact_bit_exact_and_no_leak(ams):
    eng = ams()
    cache = eng.core.cache
    bs = cache.cfg.block_size
    seen = []

    def check(req, phase, before=None):
        L = req.num_layers
        if phase == "before":
            return [(req.live_positions(l), req.kv(l, req.live_positions(l))) for l in range(L)], req.position
        snap, next_pos = before
        assert req.position == next_pos  # next_pos unchanged
        for l in range(L):
            pos_b, (k_b, v_b) = snap[l]
            pos_a = req.live_positions(l)
            if len(pos_b) <= BASE["budget"]:
                continue
            assert len(pos_a) == BASE["budget"]  # kv_len = T_keep
            idx = np.searchsorted(pos_b, pos_a)
            k_a, v_a = req.kv(l, pos_a)
            assert torch.equal(k_a, k_b[idx]) and torch.equal(v_a, v_b[idx])  # K' = K[I], bit-exact
            table = req.seq.layers[l]
            pages = [p for ps in table.pages.values() for p in ps]
            assert len(pages) == math.ceil(BASE["budget"] / bs)  # compact: old blocks went back
            pool = next(iter(cache.pools[l].values()))
            order = [int(pool.slot_pos[p, s]) for p in pages for s in range(pool.B) if pool.valid[p] >> s & 1]
            assert order == sorted(order) and len(order) == BASE["budget"]  # pos compacted, strictly increasing
        seen.append(req.step)

    with around_events(eng, check):
        res = eng.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True, chat=False))[0]
    assert len(seen) >= 20 and res.stats["ams_events"] == len(seen)
    assert cache.pages_in_use() == 0 and not cache.seqs


@pytest.mark.parametrize("params", [{}, {"scorer": "keydiff", "mode": "reference"},
                                    {"scorer": "rkv", "ablation": "fixed_segments"},
                                    {"scorer": "expected_attention", "compaction": False}])
def test_14_gather_equals_mask(ams, params):
    eng = ams(**params)
    with Probe(eng, record_sets=True, record_logits=True) as probe:
        res = eng.generate(PROMPT, SP)[0]
    rid = next(iter(probe.sets))
    ref = masked_reference_logits(eng, eng.encode_prompt(PROMPT, False), res.token_ids, probe.sets[rid])
    torch.testing.assert_close(torch.stack(probe.logits[rid]), ref, rtol=1e-4, atol=1e-4)
    assert ref.argmax(-1).tolist() == res.token_ids and res.stats["ams_events"] > 0


def test_16_batch_independence(ams):
    eng = ams()
    with Probe(eng, record_sets=True) as p1:
        alone = eng.generate(PROMPT, SP)[0]
    with Probe(eng, record_sets=True) as p2:
        batch = eng.generate([OTHER, PROMPT], [SamplingParams(max_tokens=37, ignore_eos=True, chat=False), SP])
    assert batch[1].token_ids == alone.token_ids
    assert p2.sets[max(p2.sets)] == next(iter(p1.sets.values()))


def test_22_large_t_keep_equals_full(ams, engine_factory, load_engine, tiny_ckpt):
    ref = load_engine(engine_factory(tiny_ckpt, "full")).generate(PROMPT, SP)[0]
    res = ams(budget=4096).generate(PROMPT, SP)[0]
    assert res.token_ids == ref.token_ids and res.stats["ams_events"] == 0 and res.stats["ams_noop_events"] > 0


@pytest.mark.parametrize("budget", [16, 40])
def test_23_peak_is_max_prompt_tkeep_plus_interval(ams, budget):
    res = ams(budget=budget).generate(PROMPT, SP)[0]
    P = res.stats["prompt_tokens"]
    assert res.stats["peak_live_tokens"] == max(P, budget) + BASE["interval"]


BATCH_PROMPTS = [PROMPT, OTHER, PROMPT, "Numbers: 1, 2, 3", OTHER]
BATCH_PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False) for n in (70, 55, 62, 40, 70)]


@pytest.mark.parametrize("params", [{}, {"scorer": "keydiff", "mode": "reference", "use_credit": False},
                                    {"scorer": "rkv", "ablation": "fixed_segments"},
                                    {"scorer": "expected_attention", "compaction": False, "hs": 12},
                                    {"kv_format": "int4"}, {"ablation": "no_mass", "pad_mode": "mean"}])
def test_batched_events_select_what_one_by_one_does(ams, monkeypatch, params):
    """A step's events of the batch (requests of equal length selected together) keep what each request's
    own selection keeps: the same tokens, positions held at every step and layer, credit and statistics."""
    from trtkv.policies.ams import AMSPolicy
    from trtkv.policies.base import KVPolicy

    eng = ams(**params)
    together = []  # group sizes of the joint selection

    def run(batched: bool):
        if batched:
            orig = AMSPolicy._evidence_rows

            def spy(self, layer, reqs, pos, H, queries):
                together.append(len(reqs))
                return orig(self, layer, reqs, pos, H, queries)
            monkeypatch.setattr(AMSPolicy, "_evidence_rows", spy)
        else:  # request by request, each layer through select_layer (its keep mask standing in for the evidence)
            monkeypatch.setattr(AMSPolicy, "on_decode_step_end_batch", KVPolicy.on_decode_step_end_batch)
            monkeypatch.setattr(AMSPolicy, "_evidence_rows", lambda self, layer, reqs, pos, H, queries: (np.stack([
                np.isin(np.arange(len(p)), self.select_layer(r, layer, p, np.empty(0, np.int64),
                                                             r.state.queries.of(layer), H))
                for r, p in zip(reqs, pos)]), None))
            monkeypatch.setattr(AMSPolicy, "_keep_rows", lambda self, scored: [sg.m_used for sg in scored])
        with Probe(eng, record_sets=True) as probe:
            res = eng.generate(BATCH_PROMPTS, BATCH_PARAMS)
        monkeypatch.undo()
        keys = ("ams_events", "ams_noop_events", "ams_window_mass_share", "evicted_tokens")
        return [r.token_ids for r in res], [probe.sets[i] for i in sorted(probe.sets)], \
            [{k: r.stats.get(k) for k in keys} for r in res]

    alone, batched = run(False), run(True)
    # the two copies of each prompt were selected together; a residual buffer keeps each request alone
    assert max(together, default=0) >= (0 if "kv_format" in params else 2)
    assert batched[0] == alone[0] and batched[1] == alone[1] and batched[2] == alone[2]
    assert all(st["ams_events"] > 0 for st in alone[2])


# --- 17-20: scorers -----------------------------------------------------------------------------------
def test_17_tova_scorer():
    row = torch.softmax(torch.randn(6, 30), -1)
    g = tova_scores(row, 3)
    want = row.mean(0)
    assert torch.allclose(g[:, :-1], want[None, :-1].expand(3, -1))
    assert (g[:, -1] == want[:-1].max()).all() and (g[0] == g[1]).all()


def test_18_expected_attention_zero_cov_one_future():
    torch.manual_seed(0)
    D, H, T, p0 = 8, 2, 12, 37
    inv_freq = inverse_frequencies(D, 10000.0, None)[0]
    mu = torch.randn(H, D)
    q_pre = mu[None].expand(5, -1, -1).clone()  # identical queries: Σ = 0
    keys, values = torch.randn(T, H, D), torch.randn(T, H, D)
    values = values / values.norm(dim=-1, keepdim=True)  # ‖v‖ = 1
    g = expected_attention_scores(q_pre, inv_freq, p0, 1, keys, values, epsilon=0.0, sink_slots=0)
    emb = torch.cat([p0 * inv_freq, p0 * inv_freq])
    q_rot = apply_rotary(mu[None], emb.cos()[None], emb.sin()[None])[0]  # R(p0) μ
    want = torch.softmax(torch.einsum("hd,thd->ht", q_rot, keys) / math.sqrt(D), -1)
    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


def test_18_expected_attention_covariance_term_monte_carlo():
    torch.manual_seed(1)
    D = 8
    mu = torch.randn(1, D) * 0.5
    A = torch.randn(D, D) * 0.3
    cov = (A @ A.T)[None]
    k = torch.randn(3, 1, D)
    z = ea_log_expectation(mu.double(), cov.double(), k.double())[0]
    q = torch.distributions.MultivariateNormal(mu[0].double(), cov[0].double()).sample((100000,))
    mc = torch.exp(q @ k[:, 0].double().T / math.sqrt(D)).mean(0)
    assert ((mc - z.exp()).abs() / z.exp() < 0.02).all()


def test_18_rope_average_and_unrotate():
    inv_freq = inverse_frequencies(16, 10000.0, None)[0]
    q = torch.randn(5, 3, 16)
    pos = torch.arange(10, 15)
    emb = torch.cat([pos[:, None] * inv_freq, pos[:, None] * inv_freq], -1).float()
    rotated = apply_rotary(q, emb.cos(), emb.sin())
    torch.testing.assert_close(unrotate(rotated, pos, inv_freq), q, rtol=1e-5, atol=1e-5)
    c, s = rope_average(inv_freq, 7, 1)
    torch.testing.assert_close(c, torch.cat([7 * inv_freq, 7 * inv_freq]).cos())


def test_19_keydiff():
    e1, e2 = torch.eye(4)[0], torch.eye(4)[1]
    keys = torch.stack([e1, e2, e1 - e2, e2 - e1, e1 + e2])[:, None, :]  # [T, 1, D]; anchor ∝ e1 + e2
    g = keydiff_scores(keys)[0]
    assert abs(float(g[4]) + 1) < 1e-6 and abs(float(g[2])) < 1e-6 and abs(float(g[3])) < 1e-6


def test_20_rkv_redundancy_rule():
    torch.manual_seed(2)
    keys = torch.randn(1, 10, 16)
    keys[0, 7] = keys[0, 3] * 2.0  # a duplicate pair (cosine 1)
    red = cosine_redundancy(keys, 0.5, None)

    kn = torch.nn.functional.normalize(keys[0], dim=-1)  # brute force of spec §2.10
    S = kn @ kn.T
    S.fill_diagonal_(0)
    for i in range(10):
        js = [j for j in range(10) if S[i, j] > 0.5]
        if js:
            S[i, max(js)] = 0
    torch.testing.assert_close(red[0], torch.softmax(S.mean(1), 0))
    assert S[3, 7] == 0 and S[7, 3] == 0


def test_20_rkv_protected_slots_score_highest():
    torch.manual_seed(3)
    T, Hq, H = 40, 4, 2
    rows = torch.softmax(torch.randn(8, Hq, T), -1)
    g = rkv_scores(rows, torch.randn(T, H, 16), H)
    protected = list(range(4)) + list(range(T - 8, T))
    rest = [j for j in range(T) if j not in protected]
    assert g[:, protected].min() > g[:, rest].max()


def test_window_rows_causal_mask():
    q = torch.randn(3, 4, 8)
    k = torch.randn(10, 2, 8)
    pos = np.arange(10)
    rows = window_rows(q, np.array([7, 8, 9]), k, pos, 1 / math.sqrt(8))
    assert (rows[0, :, 8:] == 0).all() and (rows[1, :, 9:] == 0).all()
    torch.testing.assert_close(rows.sum(-1), torch.ones(3, 4))


def test_reserve_select_matches_quotas():
    rng = np.random.default_rng(7)
    T, T_keep, mu, g = rand_case(rng, 300, 90)
    segs = segment(mu / mu.sum(), 0.1, 8, 64)
    must = must_keep(T, T_keep, 4, 16)
    q = allocate(segs, mu / mu.sum(), T_keep, must, 2)
    keep = select(segs, q, must, g, T_keep)
    assert len(keep) == T_keep


def test_top_in_segments_equals_each_segments_top():
    """The one-sort in-segment top-k picks what ``_top`` of each segment picks (ties: the higher index)."""
    from trtkv.policies.ams_selection import _top, _top_in_segments

    rng = np.random.default_rng(7)
    for _ in range(300):
        T, _, mu, g = rand_case(rng)
        g = np.round(g, 1)  # ties
        segs = segments_of(mu + 1e-9, CFG) if rng.random() < 0.5 else [(0, T)]
        is_must = rng.random(T) < 0.2
        q = [int(rng.integers(-1, b - a + 2)) for a, b in segs]
        want = np.concatenate([_top(np.arange(a, b)[~is_must[a:b]], g, qi) for (a, b), qi in zip(segs, q)])
        assert np.array_equal(np.sort(_top_in_segments(segs, q, is_must, g)), np.sort(want))


def test_step_queries_shared_by_the_batch():
    """The step's queries reach each request that asked, by its row of one shared record (no copy per request)."""
    from trtkv.policies.ams_queries import EventQueries, QueryLog
    from trtkv.policies.base import StepStats
    from trtkv.runtime.attention import attach_queries

    g = torch.Generator().manual_seed(0)
    logs = [QueryLog() for _ in range(3)]
    for step in range(4):
        stats = [StepStats(step=step) for _ in range(3)]
        qs = [torch.randn(3, 4, 8, generator=g) for _ in range(2)]
        attach_queries(stats, 0, qs[0], [True, False, True])
        attach_queries(stats, 1, qs[1], [True, True, True])
        assert stats[0].queries is stats[2].queries and stats[1].row == 1
        assert stats[1].query(0) is None and torch.equal(stats[2].query(0), qs[0][2])
        for i, (log, st) in enumerate(zip(logs, stats)):
            log.add(100 + step, st)
    window = EventQueries(logs)
    assert window.aligned
    assert window.counts(0).tolist() == [4, 0, 4] and window.counts(1).tolist() == [4, 4, 4]
    for layer, idx in ((0, [0, 2]), (1, [2, 1]), (1, [0, 1, 2])):
        q, pos = window.last(layer, idx, 3)
        want = [log.of(layer)[-3:] for log in (logs[i] for i in idx)]
        assert torch.equal(q, torch.stack([torch.stack([x for _, x in rec]) for rec in want]))
        assert pos.tolist() == [[p for p, _ in rec] for rec in want] == [[101, 102, 103]] * len(idx)
    # logs of different steps (continuous batching): read request by request, the same queries
    logs[1].entries.pop(0)
    window = EventQueries(logs)
    assert not window.aligned and window.counts(1).tolist() == [4, 3, 4]
    q, pos = window.last(1, [0, 1], 3)
    assert torch.equal(q[1], torch.stack([x for _, x in logs[1].of(1)[-3:]])) and pos[1].tolist() == [101, 102, 103]


@given(window=hst.integers(1, 200), hs=hst.integers(0, 40), budget=hst.integers(1, 400))
@settings(max_examples=60, deadline=None)
def test_window_of_each_row_equals_one_at_a_time(window, hs, budget):
    """An event's effective windows, all requests' at once (``_w_eff_rows``), are each one's ``_w_eff``."""
    pol = make_policy("ams", {"budget": budget, "window": window, "hs": hs})
    T = np.arange(0, 2 * budget + 3)
    assert pol._w_eff_rows(T).tolist() == [pol._w_eff(int(t)) for t in T]


def test_layer_victims_in_request_order():
    """An event's pieces of one layer (a request alone, groups of requests) come out by request, each request's
    victims in the order listed."""
    from trtkv.policies.ams import LayerVictims

    v = LayerVictims()
    v.add([3, 7], np.array([30, 31, 32, 70]), np.array([3, 1]))
    v.add([5], np.array([50, 51]))
    v.add([0, 4, 9], np.array([1, 40, 41, 42]), np.array([1, 3, 0]))
    ids, positions, counts = v.in_request_order()
    assert ids.tolist() == [0, 3, 4, 5, 7, 9] and counts.tolist() == [1, 3, 3, 2, 1, 0]
    assert positions.tolist() == [1, 30, 31, 32, 40, 41, 42, 50, 51, 70]
    one = LayerVictims()
    one.add([1, 2], np.array([[5, 6], [8, 9]])[np.array([[True, False], [True, True]])], np.array([1, 2]))
    assert [x.tolist() for x in one.in_request_order()] == [[1, 2], [5, 8, 9], [1, 2]]


@pytest.mark.parametrize("seed", range(4))
def test_one_sort_ranking_equals_two_sorts(seed):
    """The batch selection's one-sort ranking of float32 scores (packed integer keys) orders every row's slots as
    the two stable sorts do: segment, then score descending, then the higher index; -0 ties +0, infinities order
    as numbers, NaN comes after every number."""
    from trtkv.policies.ams_selection_rows import _ranked_keys, _ranked_two_sorts

    rng = np.random.default_rng(seed)
    for case in range(150):
        k, T, S = int(rng.integers(1, 20)), int(rng.integers(1, 300)), int(rng.integers(1, 12))
        g = rng.normal(size=(k, T)).astype(np.float32)
        if case % 2:
            g = np.round(g, 1).astype(np.float32)  # ties
        draw = rng.random((k, T))
        for lo, value in zip((0.0, 0.05, 0.1, 0.13, 0.15), (0.0, -0.0, np.nan, np.inf, -np.inf)):
            g[(draw >= lo) & (draw < lo + 0.04)] = value
        seg_of = np.sort(rng.integers(0, S + 1, (k, T)), axis=1)
        seg_of[:, rng.random(T) < 0.1] = S  # (must slots: past every segment)
        seg, slots = _ranked_keys(g, seg_of, S)
        want_seg, want_slots = _ranked_two_sorts(g.astype(np.float64), seg_of)
        assert np.array_equal(seg, want_seg) and np.array_equal(slots, want_slots), (seed, case)
    assert _ranked_keys(np.zeros((1, 1 << 20), np.float32), np.zeros((1, 1 << 20), np.int64), 1 << 12) is None
