"""The scoring policies' batched end of step (``ScorerPolicy.on_decode_step_end_batch``) evicts what their
request-by-request hooks evict: the same positions attended at every step and layer, the same tokens and the
same accounting, for a batch of requests of different lengths (so they fill up, fire and finish at different
steps), through the one-victim batch path and its fallbacks (buffered tokens, cadences, prompt cuts). Two
requests share a prompt (and so its length, whatever the tokenizer) but not their lengths of output, so some
one-victim cuts and residual flushes fall on the same step for several requests."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from policy_matrix import MATRIX, Probe, one_thread

import plugins.ops as plugin_ops
from trtkv.api import SamplingParams
from trtkv.cache.manager import KVCacheManager
from trtkv.policies import POLICIES
from trtkv.policies.base import KVPolicy
from trtkv.policies.lazyeviction import MRIScorer
from trtkv.policies.scored import ScorerPolicy, first_minima
from trtkv.runtime.attention import source_positions

assert one_thread  # autouse: one intra-op thread for this module

PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "Once upon a time, in a land far away, there lived a wise old king who loved puzzles and riddles.",
           "Numbers: 1, 2, 3",
           "A",
           "Tell me a story about a robot who learns to paint, with three characters and a twist at the end.",
           "The quick brown fox jumps over the lazy dog."]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False) for n in (90, 60, 75, 40, 85, 70)]
SCORED = [(e["name"], p) for e in MATRIX if issubclass(POLICIES[e["name"]], ScorerPolicy) for p in e["params"]]
EXTRA = [("h2o", {"budget": 32, "kv_format": "int4"}),  # a residual buffer: the fallback path every 16 tokens
         ("tova", {"budget": 24}), ("random", {"budget": 24, "n_sink": 2}),
         ("h2o", {"budget": 24, "recent_ratio": 0.25, "eviction": "compact"}),
         ("tova", {"budget": 24, "demote": "host"})]  # victims stay attended from host: the fallback path
CASES = SCORED + EXTRA


def _run(eng, batched: bool, monkeypatch):
    if not batched:  # request by request: per-request statistics, one hook call each
        monkeypatch.setattr(ScorerPolicy, "on_decode_step_end_batch", KVPolicy.on_decode_step_end_batch)
        monkeypatch.setattr(ScorerPolicy, "batch_stats", False)
    tracked = []  # LazyEviction: each request's TS and MRI of every layer and position when it finished
    release = MRIScorer.release

    def keep_tracked(self, memo):
        if memo.ts is not None:
            pos = np.arange(256)  # (past every request's length: the rest read 0)
            tracked.append([(self.ts(memo, layer, pos).tolist(), memo.mri.get(layer, pos).tolist())
                            for layer in range(memo.ts.table.num_layers)])
        return release(self, memo)

    monkeypatch.setattr(MRIScorer, "release", keep_tracked)
    with Probe(eng, record_sets=True) as probe:
        res = eng.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    stats = [{k: r.stats[k] for k in ("evicted_tokens", "eviction_events") if k in r.stats} for r in res]
    return [r.token_ids for r in res], [probe.sets[i] for i in sorted(probe.sets)], stats, tracked


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_batched_events_evict_what_one_by_one_does(engine_factory, load_engine, tiny_ckpt, monkeypatch, name,
                                                    params):
    eng = load_engine(engine_factory(tiny_ckpt, name, **params))
    lone_batches = []  # per layer and step: how many requests took the one-victim batch path
    orig, orig_rows = ScorerPolicy.lone_victims, ScorerPolicy.events_rows
    rows_calls = []  # steps whose statistics came in batch form (ScorerPolicy.events_rows)

    def spy(self, layer, over):
        out = orig(self, layer, over)
        lone_batches.append(sum(v is not None for v in out))
        return out

    def spy_rows(self, due, batch=None, rows=None):
        rows_calls.append(len(due))
        return orig_rows(self, due, batch, rows)

    orig_end = ScorerPolicy.on_decode_step_end_batch
    batch_form = []  # per decode step: whether its statistics came in batch form

    def spy_end(self, reqs, stats):
        batch_form.append(bool(stats) and stats[0].batch is not None)
        return orig_end(self, reqs, stats)

    orig_stacked, stacked_calls = ScorerPolicy._lone_events_layers, []  # steps whose layers went as one stack

    def spy_stacked(self, *args):
        done = orig_stacked(self, *args)
        stacked_calls.append(done)
        return done

    monkeypatch.setattr(ScorerPolicy, "_lone_events_layers", spy_stacked)
    monkeypatch.setattr(ScorerPolicy, "lone_victims", spy)  # undone by the first _run
    monkeypatch.setattr(ScorerPolicy, "events_rows", spy_rows)
    monkeypatch.setattr(ScorerPolicy, "on_decode_step_end_batch", spy_end)
    cls = type(eng.core.policy)
    orig_each, each_calls = cls.events_each, []  # events run one by one, or together (LazyEviction's)

    def spy_each(self, due):
        each_calls.append(len(due))
        return orig_each(self, due)

    monkeypatch.setattr(cls, "events_each", spy_each)
    orig_read, one_reads = KVCacheManager.table_positions_layers, []  # steps whose positions were read at once

    def spy_read(self, tables):
        every = orig_read(self, tables)
        if every is not None:  # the one read is each layer's own
            for layer, (pool, bt) in enumerate(tables):
                (pos,), counts = source_positions([(pool, bt)], bt.shape[0])
                assert np.array_equal(every[0][layer], pos) and np.array_equal(every[1][layer], counts)
        one_reads.append(every is not None)
        return every

    monkeypatch.setattr(KVCacheManager, "table_positions_layers", spy_read)
    tokens, sets, stats, tracked = _run(eng, True, monkeypatch)
    ref_tokens, ref_sets, ref_stats, ref_tracked = _run(eng, False, monkeypatch)
    assert tokens == ref_tokens
    assert stats == ref_stats
    assert tracked == ref_tracked and (name != "lazyeviction" or len(tracked) == len(PROMPTS))
    assert sets == ref_sets  # per request, decode step and layer: the positions attended
    if name in ("h2o", "tova", "random") and params.get("evict_every", 1) == 1 and "kv_format" not in params:
        assert max(rows_calls) > 1  # statistics in batch form, events for several requests at once
        # every layer as one stack, and the per-layer path (host-tier victims: attention sees more than is paged)
        assert (any(stacked_calls) or "demote" in params) and not all(stacked_calls)
        assert any(one_reads) or "demote" in params or name == "random"  # every layer's positions in one read at the step's end
    if name == "lazyeviction":
        assert max(each_calls) > 1  # several requests' events at one step: the stacked ranking ran
    # (a residual buffer: per-request statistics; random asks for none)
    if eng.policy.batch_stats and "kv_format" not in params and name != "random":
        assert any(batch_form)  # the scorer's batch path ran


@pytest.mark.parametrize("seed", range(20))
def test_first_minima_equals_argmin_per_vector(seed):
    """One ``argmin`` over the stacked scores picks each vector's own first minimum (ties and NaN included),
    for tensors and numpy arrays, stacked or not."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    rows = [torch.tensor(rng.integers(0, 3, n), dtype=torch.float32) for _ in range(int(rng.integers(1, 6)))]
    for r in rows[::2]:
        if seed % 3 == 0:
            r[rng.integers(0, n, 2)] = float("nan")
    want = [int(torch.argmin(r)) for r in rows]
    assert first_minima(rows) == want
    assert first_minima([r.numpy() for r in rows]) == [int(np.argmin(r.numpy())) for r in rows] == want
    ragged = rows + [torch.tensor([1.0, 0.0])]
    assert first_minima(ragged) == want + [1]


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_scoring_policies_declare_what_their_overrides_change():
    """The batched paths are chosen by flags, not by looking for overrides: a policy that replaces ``keep``,
    ``event`` or ``evict_layer`` (or the per-request end of step) must say so, and one that replaces
    ``protected`` must replace ``protected_rows`` with it (the batch's mask)."""
    assert {p.__name__ for p in _subclasses(ScorerPolicy)} >= {"H2OPolicy", "TOVAPolicy", "LazyEvictionPolicy"}
    for cls in _subclasses(ScorerPolicy):
        def overrides(name, cls=cls):
            return getattr(cls, name) is not getattr(ScorerPolicy, name)

        if overrides("keep"):
            assert not cls.keeps_best_scores, f"{cls.__name__} replaces keep(): set keeps_best_scores = False"
        if any(overrides(f) for f in ("keep", "event", "evict_layer", "on_decode_step_end")):
            assert not cls.batched_events, f"{cls.__name__} replaces how one event runs: set batched_events = False"
        owner = next(c for c in cls.__mro__ if "protected" in vars(c))
        assert {"protected_rows", "protected_rows_at"} & set(vars(owner)), \
            f"{owner.__name__} replaces protected() but not protected_rows_at()"
        bound_owner = next(c for c in cls.__mro__ if "protected_bound_at" in vars(c))
        assert bound_owner is ScorerPolicy or "protected_cols_at" in vars(bound_owner), \
            f"{bound_owner.__name__}'s protected_bound_at() must come with its protected_cols_at()"


@pytest.mark.parametrize("seed", range(6))
def test_random_score_rows_equal_each_request_draw(seed):
    """Random's batch scores are each request's own draw (seeded by step and layer) over its candidates, for
    rows of mixed steps and masks; the masked columns are +inf."""
    from trtkv.policies.random import RandomScorer

    rng = np.random.default_rng(seed)
    k, n = int(rng.integers(1, 7)), int(rng.integers(1, 9))
    steps = rng.integers(5, 7, k) if seed % 2 else np.full(k, 5)
    free = rng.random((k, n)) < 0.7 if seed % 3 else np.ones((k, n), bool)
    sc = RandomScorer(seed=3)
    out = sc.score_rows(1, steps, np.tile(np.arange(n), (k, 1)), free)
    for i in range(k):
        want = sc._draw(int(steps[i]), 1, int(free[i].sum()))
        assert torch.equal(out[i][torch.from_numpy(free[i])], want)
        assert torch.isinf(out[i][torch.from_numpy(~free[i])]).all()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_victims_in_columns_equal_the_first_minimum_over_sorted_positions(seed, name):
    """The column form of the one-victim choice (no sort: positions in slot order, dead columns -1) picks what the
    first minimum over ascending held positions picks: ties and NaN to the oldest, protected and dead columns
    never, a row with no finite candidate marked -1."""
    rng = np.random.default_rng(seed)
    L, k, c, n = 3, 6, 10, 7
    cols = np.full((L, k, c), -1, np.int64)
    for li in range(L):
        for i in range(k):
            cols[li, i, rng.choice(c, n, replace=False)] = rng.choice(40, n, replace=False)
    scores = torch.from_numpy(rng.integers(0, 4, (L, k, c)).astype(np.float32))  # ties
    scores[torch.from_numpy(rng.random((L, k, c)) < 0.05)] = float("nan")
    scores[torch.from_numpy(rng.random((L, k, c)) < 0.2)] = float("inf")
    policy = POLICIES[name](budget=16)

    table = torch.from_numpy(rng.random((L, k, 48)).astype(np.float32))  # the scores where each column's position is
    for li in range(L):
        for i in range(k):
            held = cols[li, i] >= 0
            table[li, i, torch.from_numpy(cols[li, i][held])] = scores[li, i][torch.from_numpy(held)]

    class Stub:
        def score_cols_layers(self, handle, got):
            assert got is cols
            return scores

        def lowest_cols_layers(self, handle, got, bound):  # (a scorer without its own table: None)
            return None

    class TableStub(Stub):  # the scores read from a table (H2O's): one table_victims pass
        def lowest_cols_layers(self, handle, got, bound):
            return plugin_ops.table_victims(table, torch.arange(k), torch.from_numpy(got),
                                            torch.from_numpy(bound), 0).numpy()

    position = rng.integers(30, 45, k)
    for stub in (Stub(), TableStub()):
        policy._scorer = stub
        got = policy._victims_in_columns(position, None, cols)
        for li in range(L):
            for i in range(k):
                order = np.argsort(cols[li, i])[c - n:]
                held, s = cols[li, i, order], scores[li, i, torch.from_numpy(order)]
                prot = policy.protected_rows_at(position[i:i + 1], held[None])[0]
                s = s.masked_fill(torch.from_numpy(prot), float("inf"))
                at = int(torch.argmin(s))
                assert got[li, i] == (-1 if torch.isinf(s[at]) else held[at])


@pytest.mark.parametrize("seed", range(8))
def test_random_shared_victims_equal_the_general_one_victim_choice(seed):
    """Random's one victim column a layer (every row at one step: one draw a layer) is what the general path —
    each row's scores, sinks masked, ``lowest_victim`` — picks; rows at different steps take the general path."""
    from trtkv.policies.scored import _lowest_victims

    rng = np.random.default_rng(seed)
    L, k, n = 4, 5, int(rng.integers(3, 10))
    held = np.sort(np.stack([[rng.choice(60, n, replace=False) for _ in range(k)] for _ in range(L)]), axis=2)
    policy = POLICIES["random"](budget=16, n_sink=int(rng.integers(0, 3)), seed=seed)
    steps = np.full(k, int(rng.integers(1, 50)))
    got = policy._shared_victims(steps, held)
    prot = policy.protected_rows_at(np.zeros(L * k, np.int64), held.reshape(L * k, n)).reshape(L, k, n)
    want = _lowest_victims(policy.scorer.score_rows_layers(steps, held, ~prot), held, prot)
    np.testing.assert_array_equal(got, want)
    steps[0] += 1
    assert policy._shared_victims(steps, held) is None
