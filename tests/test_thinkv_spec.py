"""ThinKV spec §9 properties not covered by test_thinkv.py: row sparsity (§9.1), GQA pooling (§9.2), the
residual buffer (§9.9), case-1 transition anneals (§9.11) and block-table invariants (§9.17)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trtkv.policies.thinkv import LETTER, T
from trtkv.runtime.attention import row_stats

from test_thinkv import run_engine


# --- §9.1 / §9.2: sparsity of one attention row ------------------------------------------------------

def naive_sparsity(logits: torch.Tensor, num_kv_heads: int):
    """Spec §2.2 by loops in float64: per KV group max-pool the G query-head logits, softmax over the live
    keys, count p_j < 0.01 * max p (probability space); average the groups' rows and count again.
    Returns (per-group sparsity, u, smallest relative distance of any entry to its threshold)."""
    rows = logits.double().tolist()
    Hq, n = len(rows), len(rows[0])
    G = Hq // num_kv_heads
    live = [math.isfinite(x) for x in rows[0]]
    n_live = sum(live)
    probs, per_head, margin = [], [], math.inf
    for h in range(num_kv_heads):
        pooled = [max(rows[h * G + g][j] for g in range(G)) for j in range(n)]
        m = max(x for x, ok in zip(pooled, live) if ok)
        e = [math.exp(x - m) if ok else 0.0 for x, ok in zip(pooled, live)]
        z = sum(e)
        p = [x / z for x in e]
        pmax = max(p)
        per_head.append(sum(1 for j in range(n) if live[j] and p[j] < 0.01 * pmax) / n_live)
        margin = min([margin] + [abs(pooled[j] - (m + math.log(0.01))) for j in range(n) if live[j]])
        probs.append(p)
    pbar = [sum(p[j] for p in probs) / num_kv_heads for j in range(n)]
    pbmax = max(pbar)
    u = sum(1 for j in range(n) if live[j] and pbar[j] < 0.01 * pbmax) / n_live
    margin = min([margin] + [abs(math.log(pbar[j] / pbmax) - math.log(0.01)) for j in range(n) if live[j]])
    return per_head, u, margin


def stats(logits: torch.Tensor, num_kv_heads: int):
    _, heads, u = row_stats(logits, torch.logsumexp(logits, -1), num_kv_heads)
    return heads.tolist(), u


def random_rows(Hq: int, H: int, n: int, count: int, dead: int = 0, seed: int = 0) -> list[torch.Tensor]:
    """Random float32 logit rows ``[Hq, n]`` (``dead`` keys at -inf) whose entries all lie clearly off the
    1% threshold for ``H`` KV groups, so float rounding cannot decide a count."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < count:
        lg = torch.randn(Hq, n, generator=gen) * 3.0
        if dead:
            lg[:, torch.randperm(n, generator=gen)[:dead]] = -math.inf
        if naive_sparsity(lg, H)[2] > 1e-3:
            out.append(lg)
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_uniform_and_one_hot_rows(n):
    """§9.1: a uniform logit row gives u=0; a one-hot row (one logit +100) gives u=(n-1)/n."""
    for c in (0.0, -3.5, 12.0):
        heads, u = stats(torch.full((1, n), c), 1)
        assert u == 0.0 and heads == [0.0]
    for hot in {0, n // 2, n - 1}:
        lg = torch.zeros(1, n)
        lg[0, hot] = 100.0
        heads, u = stats(lg, 1)
        assert u == pytest.approx((n - 1) / n, abs=1e-6) and heads[0] == pytest.approx((n - 1) / n, abs=1e-6)
    # GQA 4/2: every query head hot at the same key, or one query head per group hot -> still one-hot pooled
    lg = torch.zeros(4, n)
    lg[:, n - 1] = 100.0
    assert stats(lg, 2)[1] == pytest.approx((n - 1) / n, abs=1e-6)
    lg = torch.zeros(4, n)
    lg[1, 0] = lg[2, 0] = 100.0
    heads, u = stats(lg, 2)
    assert u == pytest.approx((n - 1) / n, abs=1e-6) and heads == pytest.approx([(n - 1) / n] * 2, abs=1e-6)


def test_one_hot_and_uniform_with_dead_keys():
    """§9.1 with dead (-inf) keys: n counts only the keys attended, so uniform -> 0 and one-hot -> (n-1)/n."""
    lg = torch.zeros(2, 10)
    lg[:, [1, 4, 8]] = -math.inf
    assert stats(lg, 1)[1] == 0.0 and stats(lg, 2)[1] == 0.0
    lg[:, 3] = 100.0
    assert stats(lg, 2)[1] == pytest.approx(6 / 7, abs=1e-6)
    assert stats(lg, 1)[0] == pytest.approx([6 / 7], abs=1e-6)


def test_sparsity_shift_invariant():
    """§9.1: adding a constant to all logits leaves u (and the per-group sparsities) unchanged; so does a
    different constant per KV group, since the softmax is taken per group after pooling."""
    for Hq, H in ((1, 1), (4, 2), (6, 3), (8, 1)):
        for lg in random_rows(Hq, H, 48, 6, seed=Hq * 10 + H):
            base = stats(lg, H)
            assert 0.0 < base[1] < 1.0
            for c in (5.25, -7.5):
                assert stats(lg + c, H) == base
            per_group = torch.linspace(-6.0, 6.0, H).repeat_interleave(Hq // H)[:, None]
            assert stats(lg + per_group, H) == base


def test_logit_space_test_agrees_with_probability_space():
    """§9.1: the logit test a < a_max - ln 100 (row_stats' per-head sparsity) equals the probability-space
    count p < 0.01 * p_max, both the implementation's own u on one head and a float64 naive count."""
    seen = set()
    for n, dead in ((5, 0), (33, 0), (200, 0), (40, 9)):
        for lg in random_rows(1, 1, n, 10, dead=dead, seed=n + dead):
            heads, u = stats(lg, 1)
            naive_heads, naive_u, _ = naive_sparsity(lg, 1)
            a = lg[0][torch.isfinite(lg[0])].double()
            direct = float((a < a.max() - math.log(100.0)).sum()) / len(a)
            assert heads[0] == pytest.approx(naive_heads[0], abs=1e-6)
            assert heads[0] == pytest.approx(direct, abs=1e-6)
            assert u == pytest.approx(naive_u, abs=1e-6)
            assert u == pytest.approx(heads[0], abs=1e-6)
            seen.add(round(u, 6))
    assert len(seen) > 10  # the rows span many sparsity values, not only 0 or (n-1)/n


@pytest.mark.parametrize("Hq,H", [(4, 2), (6, 2), (8, 4), (8, 1), (3, 3), (1, 1)])
def test_gqa_max_pool_matches_naive_loop(Hq, H):
    """§9.2: max-pool over the G query heads of each KV group, softmax, mean over groups, then count, equals
    a naive per-group loop; MHA (G=1) is the same code path."""
    for dead in (0, 5):
        for lg in random_rows(Hq, H, 37, 8, dead=dead, seed=100 * Hq + H + dead):
            heads, u = stats(lg, H)
            naive_heads, naive_u, _ = naive_sparsity(lg, H)
            assert heads == pytest.approx(naive_heads, abs=1e-6)
            assert u == pytest.approx(naive_u, abs=1e-6)


def test_gqa_pooling_is_max_not_mean_or_per_query_head():
    """§9.2: a key 6 nats above the rest in only one query head of a group is dominant after max-pooling
    (mean-pooling the logits, or averaging the query heads' softmax rows, would leave the row dense)."""
    n = 20
    lg = torch.zeros(4, n)  # GQA 4/2: query heads 0,1 -> group 0; 2,3 -> group 1
    lg[0, 0] = 6.0
    heads, u = stats(lg, 2)
    assert heads == pytest.approx([(n - 1) / n, 0.0])
    assert u == 0.0  # group 1 is uniform: the mean row is dense
    lg[3, 0] = 6.0  # group 1 now peaked at the same key through its other query head
    heads, u = stats(lg, 2)
    assert heads == pytest.approx([(n - 1) / n] * 2)
    assert u == pytest.approx((n - 1) / n) and naive_sparsity(lg, 2)[1] == pytest.approx((n - 1) / n)


# --- engine helpers ------------------------------------------------------------------------------

def seg_range(seg, P: int, tau: int) -> tuple[int, int]:
    return (0, P) if seg.is_prefill else (P + seg.start, P + seg.start + tau)


class Hooks:
    """Wrap policy hooks and cache methods on the instances for one run; restore them on exit."""

    def __init__(self, eng):
        self.eng, self.pol, self.cache = eng, eng.core.policy, eng.core.cache
        self.step = None  # decode index of the step in progress (None: prefill)
        self.flushes: list[tuple[int | None, int, int]] = []  # (step, layer, tokens in the buffer)
        self.evicted: dict[int, dict[int, tuple[str, int, int]]] = {}  # layer -> {position: slot it had}
        self.evict_steps: list[tuple[int | None, int, list[int]]] = []
        self.begin_checks, self.end_checks = [], []

    def __enter__(self):
        pol, cache, hooks = self.pol, self.cache, self
        begin, end = type(pol).on_decode_step_begin_batch, type(pol).on_decode_step_end_batch
        flush, evict = type(cache).flush, type(cache).evict
        flush_many, evict_many, evict_flat = type(cache).flush_many, type(cache).evict_many, type(cache).evict_flat

        # the runtime's calls (once a step for the batch): every request is checked, whether or not the batch
        # hook needed the per-request one
        def on_begin(reqs):
            hooks.step = reqs[0].step if reqs else None
            before = [[(s.sid, s.thought, s.start, s.level, s.live, s.is_prefill) for s in req.state.segments]
                      for req in reqs]
            anneals = [req.state.anneals for req in reqs]
            begin(pol, reqs)
            for req, b, a in zip(reqs, before, anneals):
                for f in hooks.begin_checks:
                    f(req, b, a)

        def on_end(reqs, stats):
            end(pol, reqs, stats)
            for req in reqs:
                segs = req.state.segments  # the policy's running total of live decode tokens (its begin hook's)
                assert req.state.live == sum(s.live for s in segs if not s.is_prefill), req.step
                for f in hooks.end_checks:
                    f(req)

        def on_flush(seq, layer, cls, seg=-1):
            hooks.flushes.append((hooks.step, layer, seq.buffered(layer)))
            return flush(cache, seq, layer, cls, seg)

        def on_flush_many(layer, seqs, classes, segs, plan=None):
            for seq in seqs:
                hooks.flushes.append((hooks.step, layer, seq.buffered(layer)))
            return flush_many(cache, layer, seqs, classes, segs, plan)

        def hits(seq, layer, positions):
            table = seq.layers[layer]
            pos = [int(p) for p in (positions.tolist() if hasattr(positions, "tolist") else positions)]
            return {p: table.loc[p] for p in pos if p in table.loc}

        def record(layer, hit):
            hooks.evicted.setdefault(layer, {}).update(hit)
            hooks.evict_steps.append((hooks.step, layer, sorted(hit)))

        def on_evict(seq, layer, positions):
            hit = hits(seq, layer, positions)
            n = evict(cache, seq, layer, positions)
            assert n == len(hit)
            record(layer, hit)
            return n

        def on_evict_many(layer, items, counted=True):
            hit = [hits(seq, layer, positions) for seq, positions in items]
            counts = evict_many(cache, layer, items, counted)
            assert counts == [len(h) for h in hit]
            for h in hit:
                record(layer, h)
            return counts

        def on_evict_flat(layer, seqs, positions, lens, counted=True):
            ends = np.cumsum(lens).tolist()
            hit = [hits(seq, layer, positions[end - n:end]) for seq, n, end in zip(seqs, lens.tolist(), ends)]
            counts = evict_flat(cache, layer, seqs, positions, lens, counted)
            assert counts == [len(h) for h in hit]
            for h in hit:
                record(layer, h)
            return counts

        pol.on_decode_step_begin_batch, pol.on_decode_step_end_batch = on_begin, on_end
        cache.flush, cache.evict = on_flush, on_evict
        cache.flush_many, cache.evict_many, cache.evict_flat = on_flush_many, on_evict_many, on_evict_flat
        return self

    def __exit__(self, *exc):
        del self.pol.on_decode_step_begin_batch, self.pol.on_decode_step_end_batch
        del self.cache.flush, self.cache.evict, self.cache.flush_many, self.cache.evict_many, self.cache.evict_flat
        sched = self.eng.scheduler  # a failed check leaves its request running in the shared engine: drop it
        for r in [*sched.waiting, *sched.running]:
            r.cancelled = True
        if sched.has_work:
            sched.step()
        return False


# --- §9.9: residual buffer ------------------------------------------------------------------------

BUDGET_ENGINE = dict(block_size=4, tau=8, group=4, retention="4,2", budget=20, thought_schedule="RTETRRTE")


def test_residual_buffer_bounds_flushes_and_conservation(engine_factory, load_engine, tiny_ckpt):
    """§9.9: after every decode step 0 <= buffered < g in every layer; a flush happens exactly when the
    count reaches g (and only then); per layer prompt + processed tokens = live in pages + evicted +
    buffered, with the three sets of positions disjoint. (R4E4T2, budget-driven and transition evictions.)"""
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", **BUDGET_ENGINE))
    g, L, P, N = 4, 2, 10, 90  # P % g != 0: the prompt's tail is flushed as a partial group
    seen = []

    def check(req):
        seq, i = req.seq, req.step  # i tokens have been decoded (their K/V written)
        for layer in range(L):
            buf = seq.buffered(layer)
            assert 0 <= buf < g
            assert buf == i % g, f"step {i}: {buf} tokens buffered in layer {layer}"
            in_pages = set(seq.layers[layer].loc)
            buffered = set(seq.buffered_positions(layer))
            evicted = set(hooks.evicted.get(layer, {}))
            assert not (in_pages & buffered or in_pages & evicted or buffered & evicted)
            assert P + i == len(in_pages) + len(evicted) + buf
            assert in_pages | buffered | evicted == set(range(P + i))
        assert seq.evicted_tokens == sum(len(v) for v in hooks.evicted.values())
        seen.append(i)

    with Hooks(eng) as hooks:
        hooks.end_checks.append(check)
        req, _ = run_engine(eng, list(range(500, 500 + P)), N)
    assert seen == list(range(1, N))  # N tokens generated: the prefill samples one, then N - 1 decode steps
    assert all(n == g for _, _, n in hooks.flushes), "a flush with a count other than g"
    for layer in range(L):
        steps = [s for s, lay, _ in hooks.flushes if lay == layer]
        assert steps == [i for i in range(N - 1) if i % g == g - 1]
    assert sum(len(v) for v in hooks.evicted.values()) > 0
    assert req.result.stats["thinkv"]["transition_anneals"] > 0


# --- §9.11: case 1 -------------------------------------------------------------------------------

SCHED = "RTTETRER"  # decode segment j is labelled SCHED[j % 8]: two consecutive T, then T after E


def test_case1_transition_anneals(engine_factory, load_engine, tiny_ckpt):
    """§9.11: case 1 fires exactly once per closed T segment, at the next refresh; every earlier
    non-minimum segment drops exactly one level (live = min(live, RET[level])), minimum-level segments,
    the triggering segment, the prompt and the new segment are untouched; closing R or E triggers nothing.
    No budget, so nothing else anneals; the evictions in every layer match the decided live counts."""
    tau, ret = 8, (4, 2)
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", block_size=4, tau=tau, group=4, retention="4,2",
                                     precision="R16E16T16", thought_schedule=SCHED, budget="none"))
    assert eng.core.policy.anneal_triggering_t is False
    P, N, L = 10, 100, 2
    fired, non_firing_refreshes, skipped_min = [], [], 0

    def check_begin(req, before, anneals_before):
        nonlocal skipped_min
        i, segs = req.step, req.state.segments
        refresh = i % tau == 0
        assert len(segs) == len(before) + (1 if refresh else 0)
        if refresh:
            new = segs[-1]
            assert (new.start, new.level, new.live) == (i, 0, 0)
            assert new.thought == LETTER[SCHED[(len(segs) - 2) % len(SCHED)]]
        closed = before[-1] if refresh and not before[-1][5] else None
        trig = closed is not None and closed[1] == T
        assert req.state.anneals - anneals_before == int(trig)
        if trig:
            fired.append((i, closed[0]))
        elif closed is not None:
            non_firing_refreshes.append(i)
        for (sid, thought, start, level, live, prefill), seg in zip(before, segs):
            assert (seg.sid, seg.thought, seg.start) == (sid, thought, start)
            if trig and not prefill and start < closed[2] and level < len(ret):
                assert seg.level == level + 1, f"step {i}: segment {sid} level {level} -> {seg.level}"
                assert seg.live == min(live, ret[level])
            else:
                skipped_min += trig and not prefill and start < closed[2]
                assert (seg.level, seg.live) == (level, live), f"step {i}: segment {sid} changed"

    def check_end(req):
        seq, segs = req.seq, req.state.segments
        for layer in range(L):
            loc = seq.layers[layer].loc
            for seg in segs:
                lo, hi = seg_range(seg, P, tau)
                assert sum(1 for p in loc if lo <= p < hi) == seg.live, (req.step, layer, seg)

    with Hooks(eng) as hooks:
        hooks.begin_checks.append(check_begin)
        hooks.end_checks.append(check_end)
        req, _ = run_engine(eng, list(range(600, 600 + P)), N)
    # one event per T segment closed at a refresh during the run, at that refresh
    closed_t = [(tau * (j + 1), j + 1) for j in range(N // tau) if SCHED[j % len(SCHED)] == "T"
                and tau * (j + 1) <= N - 2]  # decode steps run 0 .. N-2
    assert fired == closed_t
    assert req.result.stats["thinkv"]["transition_anneals"] == len(closed_t)
    assert non_firing_refreshes and skipped_min > 0  # R/E closures and minimum-level segments were exercised
    # evictions happen only in the steps where case 1 fired, only in earlier segments, in every layer
    fire_steps = {i for i, _ in fired}
    assert {s for s, _, pos in hooks.evict_steps if pos} == fire_steps
    for s, layer, pos in hooks.evict_steps:
        trig_start = P + s - tau
        assert all(P <= p < trig_start for p in pos), (s, layer, pos)
    for layer in range(L):
        assert {s for s, lay, pos in hooks.evict_steps if lay == layer and pos} == fire_steps


# --- §9.17: block-table invariants --------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"precision": "R16E16T16", "budget": "none", "thought_schedule": SCHED}],
                         ids=["r4e4t2-budget", "fp16-case1"])
def test_block_table_invariants(engine_factory, load_engine, tiny_ckpt, extra):
    """§9.17 after every step: a valid slot has slot_seg >= 0 and its page's thought class equals its
    segment's type; the valid slots number the sum of segment live counts; a freed (evicted) slot has
    slot_seg == -1 (and no position)."""
    params = {**BUDGET_ENGINE, **extra}
    eng = load_engine(engine_factory(tiny_ckpt, "thinkv", **params))
    cache, P, N, L, B = eng.core.cache, 10, 90, 2, 4
    reused = []

    def check(req):
        seq, segs = req.seq, req.state.segments
        assert [s.sid for s in segs] == list(range(len(segs)))
        total_live = sum(s.live for s in segs)
        for layer in range(L):
            table = seq.layers[layer]
            valid = 0
            for (fmt, cls), pages in table.pages.items():
                pool = cache.pools[layer][fmt]
                for p in pages:
                    assert pool.page_class[p] == cls
                    bits = int(pool.valid[p])
                    for s in range(B):
                        sid = int(pool.slot_seg[p, s])
                        if bits >> s & 1:
                            valid += 1
                            assert sid >= 0, f"valid slot ({fmt}, {p}, {s}) has slot_seg {sid}"
                            assert segs[sid].thought == pool.page_class[p]
                            pos = int(pool.slot_pos[p, s])
                            assert table.loc[pos] == (fmt, p, s)
                            lo, hi = seg_range(segs[sid], P, params["tau"])
                            assert lo <= pos < hi, "slot_seg names a segment that does not hold the token"
                        elif s < pool.hwm[p]:
                            assert sid == -1 and pool.slot_pos[p, s] == -1, f"freed slot ({fmt}, {p}, {s})"
            assert valid == total_live == len(table.loc), (req.step, layer, valid, total_live)
            for pos, (fmt, p, s) in hooks.evicted.get(layer, {}).items():
                pool = cache.pools[layer][fmt]
                if int(pool.valid[p]) >> s & 1:
                    reused.append(pos)
                    assert int(pool.slot_pos[p, s]) != pos
                else:
                    assert pool.slot_seg[p, s] == -1 and pool.slot_pos[p, s] == -1

    with Hooks(eng) as hooks:
        hooks.end_checks.append(check)
        run_engine(eng, list(range(700, 700 + P)), N)
    assert hooks.evicted and reused  # evictions happened and freed slots were reused in place
