"""LazyEviction: the testable properties of shared/specs/lazyeviction.md §8 (numbers in the test names)."""
from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import pytest
import torch
from policy_matrix import Probe, masked_reference_logits, one_thread

from trtkv.api import SamplingParams
from trtkv.policies.lazyeviction import lexi_top, mri_score, track

SP = SamplingParams(max_tokens=90, ignore_eos=True, chat=False)
PROMPT = "Once upon a time, in a land far away, there lived a wise old king who loved puzzles and riddles."
OTHER = "The quick brown fox jumps over the lazy dog."
B, W = 16, 4
assert one_thread  # autouse: one intra-op thread for this module


@pytest.fixture(scope="module")
def le(engine_factory, load_engine, tiny_ckpt):
    def get(**params):
        params = {"budget": B, "window": W, **params}
        return load_engine(engine_factory(tiny_ckpt, "lazyeviction", **params))
    return get


@contextlib.contextmanager
def step_log(eng):
    """Per decode step of every request: (t, sizes before the policy acted, sizes after, positions after per
    layer, pages of layer 0 after)."""
    pol = eng.core.policy
    log: dict[int, list] = {}

    def on_decode_step_end_batch(reqs, stats):
        before = [[req.num_live(l) for l in range(req.num_layers)] for req in reqs]
        type(pol).on_decode_step_end_batch(pol, reqs, stats)
        for req, b in zip(reqs, before):
            after = [req.num_live(l) for l in range(req.num_layers)]
            pos = [set(req.live_positions(l).tolist()) | set(req.buffered_positions(l))
                   for l in range(req.num_layers)]
            pages = sum(len(p) for p in req.seq.layers[0].pages.values())
            log.setdefault(req.req_id, []).append((req.step, b, after, pos, pages))

    pol.on_decode_step_end_batch = on_decode_step_end_batch
    try:
        yield log
    finally:
        del pol.on_decode_step_end_batch


# --- 1: no-op when the budget is large --------------------------------------------------------------
def test_1_large_budget_is_full_kv(le, engine_factory, load_engine, tiny_ckpt):
    full = load_engine(engine_factory(tiny_ckpt, "full"))
    ref = full.generate(PROMPT, SP)[0]
    res = le(budget=4096, window=W).generate(PROMPT, SP)[0]
    assert res.token_ids == ref.token_ids and res.stats["evicted_tokens"] == 0


# --- 2, 3, 4, 5, 14: cadence, sizes, recent window, equal counts, hole reuse --------------------
def test_2_3_4_5_14_cadence_sizes_window_pages(le):
    eng = le()
    with step_log(eng) as log:
        res = eng.generate(PROMPT, SP)[0]
    P = res.stats["prompt_tokens"]
    steps = next(iter(log.values()))
    first = None
    bs = eng.core.cache.cfg.block_size
    cap_pages = math.ceil((max(P, B) + W) / bs)
    for t, before, after, pos, pages in steps:
        assert len(set(before)) == 1 and len(set(after)) == 1  # 5: equal counts in every layer
        evicted = after[0] < before[0]
        if evicted:
            assert t % W == 0 and before[0] > B  # 2: only at multiples of W, only over budget
            assert after[0] == B  # 3: exactly B after an eviction
            first = t if first is None else first
            newest = max(pos[0])
            for layer_pos in pos:  # 4: the W most recent tokens survive in every layer
                assert set(range(newest - W + 1, newest + 1)) <= layer_pos
        else:
            assert not (t % W == 0 and before[0] > B)
        if first is not None:
            assert B <= after[0] <= B + W  # 3
            assert t == first or before[0] <= B + W  # the first eviction may see max(P, B) + W
            assert pages <= cap_pages  # 3/14: no page beyond ceil((max(P, B) + W) / block)
    assert first is not None
    # 2: between evictions the cache grows by exactly one token per step
    sizes = [(b[0], a[0]) for _, b, a, _, _ in steps]
    for (b0, a0), (b1, _) in zip(sizes, sizes[1:]):
        assert b1 == a0 + 1
    assert res.stats["eviction_events"] == sum(a[0] < b[0] for _, b, a, _, _ in steps)


def test_14_hole_reuse_no_new_pages_after_eviction(le):
    eng = le()
    with step_log(eng) as log:
        eng.generate(PROMPT, SP)
    steps = next(iter(log.values()))
    for i, (t, before, after, _, pages) in enumerate(steps):
        if after[0] < before[0]:
            nxt = [s[4] for s in steps[i + 1: i + W]]  # the next W-1 tokens land in freed cells
            assert all(p <= pages for p in nxt), (t, pages, nxt)


# --- 6: tracker semantics ----------------------------------------------------------------------
def test_6_tracker_synthetic_trace():
    ts, mri = torch.tensor([0]), torch.tensor([0])
    seen = []
    for t in range(1, 16):
        ts, mri = track(t, ts, mri, torch.tensor([t in (3, 5, 12)]))
        if t in (3, 5, 12):
            seen.append(int(mri))
    assert seen == [3, 3, 7] and int(ts) == 12
    ts, mri = torch.tensor([0]), torch.tensor([0])
    for t in range(1, 10):
        ts, mri = track(t, ts, mri, torch.tensor([False]))
    assert int(mri) == 0 and int(ts) == 0


def test_6_tracker_monotone_random():
    g = torch.Generator().manual_seed(0)
    ts = torch.zeros(50, dtype=torch.long)
    mri = torch.zeros(50, dtype=torch.long)
    for t in range(1, 200):
        act = torch.rand(50, generator=g) < 0.1
        ts2, mri2 = track(t, ts, mri, act)
        assert (ts2 >= ts).all() and (mri2 >= mri).all() and (ts2 <= t).all() and (mri2 <= t).all()
        ts, mri = ts2, mri2


# --- 7, 8: the score ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ts,m,want", [(100, 3, 1.03597), (90, 20, 0.75508), (95, 2, 0.24657), (97, 3, 0.57386),
                                       (60, 0, 0.0), (100, 0, 1.0)])
def test_7_score_worked_values(ts, m, want):
    got = float(mri_score(100, torch.tensor([ts]), torch.tensor([m]))[0])
    assert abs(got - want) < 1e-5


def test_7_score_shape():
    t = 1000
    e = torch.arange(0, 200)
    for m in (1, 3, 10, 50):
        s = mri_score(t, t - e, torch.full_like(e, m))
        assert (s[1:] <= s[:-1]).all()  # decreasing in e for fixed MRI
    m = torch.arange(1, 100)
    for e0 in (1, 5, 40):
        h1 = mri_score(t, torch.full_like(m, t - e0), m, ablate="no_h2")
        h2 = mri_score(t, torch.full_like(m, t), m, ablate="no_h1")
        assert (h1[1:] >= h1[:-1]).all() and (h2[1:] <= h2[:-1]).all()
    g = torch.Generator().manual_seed(1)
    ts = torch.randint(0, t + 1, (5000,), generator=g)
    mri = torch.randint(0, t, (5000,), generator=g)
    s = mri_score(t, ts, mri)
    assert float(s.min()) >= 0 and float(s.max()) <= 1 + 2 / (1 + math.e ** 2) + 1e-6


def _spec_score(t, ts, mri, form, ablate):
    """Spec §3.4 written out: one temporary an op, out of place (what ``mri_score`` computes in place)."""
    decay = {"sigmoid": lambda x: 2.0 * torch.sigmoid(-x), "exp": lambda x: torch.exp(-x),
             "tanh": lambda x: 1.0 - torch.tanh(x), "inverse": lambda x: 1.0 / (1.0 + x)}[form]
    e, m = (t - ts).double(), mri.double()
    h1 = torch.where(e == 0, torch.ones_like(e), torch.where(m > 0, decay(e / m.clamp(min=1)), torch.zeros_like(e)))
    h2 = torch.where(m > 0, decay(m + 1), torch.zeros_like(m))
    h1 = torch.zeros_like(h1) if ablate == "no_h1" else h1
    h2 = torch.zeros_like(h2) if ablate == "no_h2" else h2
    return (h1 + h2).float()


@pytest.mark.parametrize("form", ["sigmoid", "exp", "tanh", "inverse"])
@pytest.mark.parametrize("ablate", ["none", "no_h1", "no_h2"])
def test_7_score_in_place_equals_the_spec_formula_bit_for_bit(form, ablate):
    """Every layer's stack of candidates, one step a row (ties of e = 0 and MRI = 0 included): the same float32
    bits as the formula with a temporary an op."""
    g = torch.Generator().manual_seed(3)
    step = torch.randint(50, 200, (1, 16, 1), generator=g)
    ts = torch.clamp(step - torch.randint(0, 60, (4, 16, 40), generator=g), min=0)
    mri = torch.randint(0, 30, (4, 16, 40), generator=g) * (torch.rand(4, 16, 40, generator=g) < 0.7)
    got = mri_score(step, ts, mri, form, ablate)
    assert got.dtype == torch.float32 and torch.equal(got, _spec_score(step, ts, mri, form, ablate))


def test_8_mri0_evicted_first():
    rng = np.random.default_rng(0)
    t = 500
    pos = np.arange(200)
    mri = rng.integers(0, 40, 200)
    ts = np.where(mri > 0, rng.integers(100, t, 200), rng.integers(0, t, 200))
    s = mri_score(t, torch.from_numpy(ts), torch.from_numpy(mri)).numpy()
    for k in (10, 60, 150):
        keep = set(lexi_top(pos, s, mri, ts, k).tolist())
        dropped = set(pos.tolist()) - keep
        if any(mri[p] == 0 for p in keep):
            assert all(mri[p] == 0 for p in dropped)  # a zero-MRI token survives only when all others did


# --- 9: degenerate alpha ----------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.0, 2.0])
def test_9_degenerate_alpha_is_sliding_window(le, alpha):
    eng = le(alpha=alpha)
    with step_log(eng) as log:
        eng.generate(PROMPT, SP)
    steps = next(iter(log.values()))
    assert any(a[0] < b[0] for _, b, a, _, _ in steps)
    for t, before, after, pos, _ in steps:
        if after[0] < before[0]:
            newest = max(pos[0])
            for layer_pos in pos:
                assert layer_pos == set(range(newest - B + 1, newest + 1))


# --- 10: selection equals a brute-force sort ----------------------------------------------------
def test_10_selection_matches_bruteforce():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 60)
        t = rng.randint(60, 120)
        pos = np.array(sorted(rng.sample(range(300), n)))
        mri = np.array([rng.choice([0, 0, 1, 2, 3, 17, 40]) for _ in range(n)])
        ts = np.array([rng.randint(0, t) for _ in range(n)])
        s = mri_score(t, torch.from_numpy(ts), torch.from_numpy(mri)).numpy()
        k = rng.randint(0, n)
        want = sorted(range(n), key=lambda i: (-float(s[i]), mri[i], -ts[i], -pos[i]))[:k]
        assert lexi_top(pos, s, mri, ts, k).tolist() == sorted(pos[want].tolist())


# --- 12, 13: positions and masking equivalence ------------------------------------------------------
@pytest.mark.parametrize("params", [{}, {"alpha": 1e-2, "window": 8, "budget": 20}])
def test_12_13_equals_full_with_evicted_tokens_masked(le, params):
    eng = le(**params)
    with Probe(eng, record_sets=True, record_logits=True) as probe:
        res = eng.generate(PROMPT, SP)[0]
    rid = next(iter(probe.sets))
    ref = masked_reference_logits(eng, eng.encode_prompt(PROMPT, False), res.token_ids, probe.sets[rid])
    torch.testing.assert_close(torch.stack(probe.logits[rid]), ref, rtol=1e-4, atol=1e-4)
    assert res.stats["evicted_tokens"] > 0


# --- 15, 16: determinism and batch independence -------------------------------------------------------
def test_15_16_deterministic_and_batch_independent(le):
    eng = le()
    with Probe(eng, record_sets=True) as p1:
        a = eng.generate(PROMPT, SP)[0]
    with Probe(eng, record_sets=True) as p2:
        b = eng.generate(PROMPT, SP)[0]
    with Probe(eng, record_sets=True) as p3:
        batch = eng.generate([OTHER, PROMPT], [SamplingParams(max_tokens=50, ignore_eos=True, chat=False), SP])
    sets = [next(iter(p.sets.values())) for p in (p1, p2)]
    assert a.token_ids == b.token_ids and sets[0] == sets[1]
    rid = max(p3.sets)  # PROMPT is the second request of the batch
    assert batch[1].token_ids == a.token_ids and p3.sets[rid] == sets[0]


def test_soft_bound_reported(le):
    eng = le()
    res = eng.generate(PROMPT, SP)[0]
    P = res.stats["prompt_tokens"]
    assert res.stats["peak_live_tokens"] == min(P + SP.max_tokens, max(P, B) + W)


def test_stacked_events_equal_layer_by_layer(le, monkeypatch):
    """A lockstep batch's events (same held count in every layer) scored and ranked as one [L, k, n] stack keep
    exactly the tokens the layer-by-layer path keeps, and that path did run."""
    eng = le()
    prompts = [PROMPT, PROMPT.upper(), PROMPT[::-1]]
    lengths = {len(eng.tokenizer.encode(p)) for p in prompts}
    prompts = [PROMPT] * 3 if len(lengths) != 1 else prompts  # (lockstep needs one prompt length)
    pol, stacked, runs = eng.core.policy, type(eng.core.policy)._events_stacked, []

    def counted(self, *args):
        runs.append(stacked(self, *args))
        return runs[-1]

    with Probe(eng, record_sets=True) as fast:
        monkeypatch.setattr(type(pol), "_events_stacked", counted)
        want = [r.token_ids for r in eng.generate(prompts, SP)]
    assert any(runs)
    monkeypatch.setattr(type(pol), "_events_stacked", lambda self, *args: False)
    with Probe(eng, record_sets=True) as slow:
        got = [r.token_ids for r in eng.generate(prompts, SP)]
    assert got == want
    assert [fast.sets[k] for k in sorted(fast.sets)] == [slow.sets[k] for k in sorted(slow.sets)]
