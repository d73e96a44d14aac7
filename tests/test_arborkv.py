"""ArborKV (spec §8) and the tree search it runs in: rules, events, rehydration, positions, masking, leaks."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trtkv.errors import TrtkvError
from trtkv.policies import make_policy
from trtkv.policies.arborkv_rules import TAEParams, extractive_keep, fit_theta, msve_score, tae_keep, tae_weight
from trtkv.runtime.observers import EngineObserver
from trtkv.search import SearchConfig, SearchProblem, get_task, run_search

CFG = SearchConfig(branching=2, depth=3, expansions=7, node_tokens=12, temperature=0.7, top_p=1.0, seed=1)
PUZZLE = "4 9 10 13"


@pytest.fixture(scope="module")
def tiny_full(engine_factory, load_engine, tiny_ckpt):
    return load_engine(engine_factory(tiny_ckpt, "full"))


def _core(engine, policy=None, **params):
    pol = make_policy(policy, params) if policy else None
    if pol is not None:
        pol.resolve_formats("fp32")
    return engine.make_core(policy=pol)


def _search(engine, core, cfg=CFG, on_tree=None, task="game24", problem=PUZZLE, observer=None):
    if observer is not None:
        core.attach(observer)
    rec = run_search(core, lambda t: engine.encode_prompt(t, False), get_task(task),
                     SearchProblem.from_text(task, problem), cfg, on_tree=on_tree)
    assert rec["live_pages_after"] == 0 and not core.cache.seqs and len(core.cache.refs) == 0  # no page leaks
    return rec


def _nodes(tree):
    return {i: (n.parent, n.start, list(n.token_ids), n.confidence) for i, n in tree.nodes.items()}


# --- rules ------------------------------------------------------------------------------------------
def test_tae_hand_check_and_monotonicity():  # spec §8.8
    p = TAEParams(alpha=1, gamma=2, eta=0.5, lambda_delta=0.5, k_min=16, l_tail=8)
    assert tae_weight(p, 0.8, 0, 2, on_path=False) == pytest.approx(0.1177, abs=1e-4)
    assert math.floor(0.1177 * 128) == 15 and tae_keep(p, 128, 0.8, 0, 2, on_path=False) == 16
    rng = random.Random(0)
    for _ in range(200):
        q = TAEParams(alpha=rng.uniform(0.1, 3), gamma=rng.uniform(0.5, 3), eta=rng.uniform(0.1, 1),
                      lambda_delta=rng.uniform(0, 1), r_min=rng.uniform(0, 0.3))
        s, d = rng.random(), rng.randint(0, 6)

        def r(q=q, s=s, d=d, on=False):
            return min(1.0, max(q.r_min, tae_weight(q, s, 1, d, on)))
        assert q.r_min <= r() <= 1
        assert r(s=min(1, s + 0.1)) >= r()
        assert r(d=d + 1) <= r()
        assert r(q=TAEParams(**{**q.__dict__, "alpha": q.alpha * 2})) >= r()
        assert r(on=True) >= r()  # eta discounts off-path blocks only
        assert tae_weight(q, s, 1, d, True) == pytest.approx(tae_weight(q, s, 1, d, False) / q.eta)


def test_extractive_keep_counts_tail_and_heavy_hitters():  # spec §8.5, §8.7, §8.10
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        res = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
        acc = rng.integers(0, 5, n).astype(float)
        k = int(rng.integers(0, n + 1))
        keep = extractive_keep(res, n, k, acc, 8, set())
        assert set(keep) <= set(res) and len(keep) == min(k, len(res))
        if len(keep) <= 8:
            assert keep == res[len(res) - len(keep):]  # k <= L_tail: exactly the last k
        else:
            tail = [o for o in res if o >= n - 8]
            assert set(tail) <= set(keep)
            rest = [o for o in res if o not in tail]
            brute = sorted(rest, key=lambda o: (-acc[o], -o))[: len(keep) - len(tail)]
            assert set(keep) == set(tail) | set(brute)


def test_msve_ranges_and_theta_fit():  # spec §8.17 (the §3.8 fit)
    assert 0 <= msve_score((3, 1, 2, -2), 0, 0, 0) < msve_score((3, 1, 2, -2), 1, 1, 1) <= 1
    rng = np.random.default_rng(0)
    x = rng.random((4000, 3))
    true = np.array([3.0, 1.0, 2.0, -2.0])
    y = (rng.random(4000) < 1 / (1 + np.exp(-(x @ true[:3] + true[3])))).astype(float)
    theta = fit_theta(x, y, l2=0.0)
    assert np.allclose(theta, true, atol=0.5)


def test_distance_matches_bfs_on_random_trees():  # spec §8.9
    from trtkv.runtime.tree import SearchTree, TreeNode

    rng = random.Random(0)
    for _ in range(20):
        t = SearchTree(None, "", [], 0.0, 1.0, 0, 8, 100)
        t.nodes[0] = TreeNode(0, None, 0, 0)
        for i in range(1, 30):
            par = rng.randrange(i)
            t.nodes[i] = TreeNode(i, par, t.nodes[par].depth + 1, 0)
            t.nodes[par].children.append(i)
        t.active_leaf = rng.randrange(30)
        adj = {i: set(n.children) | ({n.parent} if n.parent is not None else set()) for i, n in t.nodes.items()}
        dist, frontier = {t.active_leaf: 0}, [t.active_leaf]
        while frontier:
            nxt = []
            for u in frontier:
                for v in adj[u] - dist.keys():
                    dist[v] = dist[u] + 1
                    nxt.append(v)
            frontier = nxt
        assert all(t.distance(i) == dist[i] for i in t.nodes)
    leaf = t.active_leaf
    assert t.distance(leaf) == 0


# --- search -----------------------------------------------------------------------------------------
def test_large_budget_equals_full(tiny_full):  # spec §8.1
    trees = {}
    rec_full = _search(tiny_full, _core(tiny_full), on_tree=lambda t: trees.setdefault("full", _nodes(t)))
    rec_arbor = _search(tiny_full, _core(tiny_full, "arborkv", budget_basis="absolute", kv_budget=100_000),
                        on_tree=lambda t: trees.setdefault("arbor", _nodes(t)))
    assert trees["full"].keys() == trees["arbor"].keys()
    for i, (par, start, toks, u) in trees["full"].items():
        assert trees["arbor"][i][:3] == (par, start, toks)
        assert trees["arbor"][i][3] == pytest.approx(u, abs=1e-5)  # logits (stats path vs plain kernel)
    assert rec_arbor["rehydrations"] == 0 and rec_arbor["budget_violations"] == 0
    assert rec_full["peak_cached_tokens"] == rec_arbor["peak_cached_tokens"]


class PathWatch(EngineObserver):
    """At every decode step: the active leaf holds every position below it in every layer, and the sinks."""

    def __init__(self, n_sink):
        self.n_sink, self.steps = n_sink, 0

    def before_attention(self, reqs, layer):
        for r in reqs:
            held = set(r.ctx.all_positions(layer).tolist())
            assert held == set(range(r.ctx.position + 1))  # spec §8.3 (the step's own token included)
            assert set(range(self.n_sink)) <= held  # spec §8.4
        self.steps += 1


def test_tight_budget_keeps_the_path_and_rehydrates(tiny_full):  # spec §8.3, §8.4, §8.13
    core = _core(tiny_full, "arborkv", kv_ratio=0.45, k_min=2, l_tail=2)
    pol = core.policy
    checks = []
    orig = pol._pressure

    def pressure(tree, st, reserve=0):
        before = st.violations
        orig(tree, st, reserve)
        checks.append(tree.cached_tokens() + reserve <= st.budget - 2 * st.delta or st.violations == before + 1)
    pol._pressure = pressure
    watch = PathWatch(pol.n_sink)
    seen = {}

    def on_tree(tree):
        seen["full"] = [i for i, n in tree.nodes.items() if i and len(tree.resident(i)) == n.n]
        for i in tree.path():
            assert len(tree.resident(i)) == tree.nodes[i].n or not tree.nodes[i].closed
    rec = _search(tiny_full, core, cfg=CFG.replace(expansions=9), observer=watch, on_tree=on_tree)
    assert watch.steps > 0 and checks and all(checks)
    assert rec["pressure_events"] > 0 and rec["policy_evictions"] > 0
    assert rec["rehydrations"] > 0  # branch switches brought evicted blocks back onto the path
    rec_full = _search(tiny_full, _core(tiny_full), cfg=CFG.replace(expansions=9))
    assert rec["peak_cached_tokens"] < rec_full["peak_cached_tokens"]


def test_offpath_blocks_in_thinkv_format_same_tree_fewer_bytes(tiny_full):
    """Beyond the paper: off-path blocks re-stored in fp8 are never attended while off the path and are
    rebuilt in the base format when they come back, so the search is unchanged and holds fewer bytes."""
    trees, recs = {}, {}
    for fmt in ("none", "fp8"):
        core = _core(tiny_full, "arborkv", kv_ratio=0.9, k_min=2, l_tail=2, offpath_format=fmt)
        recs[fmt] = _search(tiny_full, core, cfg=CFG.replace(expansions=9),
                            on_tree=lambda t, fmt=fmt: trees.setdefault(fmt, _nodes(t)))
    assert recs["fp8"]["converted_tokens"] > 0 and recs["none"]["converted_tokens"] == 0
    assert {i: v[:3] for i, v in trees["fp8"].items()} == {i: v[:3] for i, v in trees["none"].items()}
    assert recs["fp8"]["peak_cached_tokens"] == recs["none"]["peak_cached_tokens"]
    assert recs["fp8"]["peak_kv_bytes"] < recs["none"]["peak_kv_bytes"]


def test_positions_of_children(tiny_full):  # spec §8.15
    core = _core(tiny_full, "arborkv", kv_ratio=0.45, k_min=2, l_tail=2)

    def on_tree(tree):
        for i, n in tree.nodes.items():
            if n.parent is None:
                continue
            par = tree.nodes[n.parent]
            assert n.start == par.start + par.n
            assert n.request.prompt_len == n.start  # RoPE position of the block's first token
            sib = [tree.nodes[c].start for c in par.children]
            assert len(set(sib)) == 1
    _search(tiny_full, core, on_tree=on_tree)


def _kv_span(ctx, positions):
    return [ctx.kv(layer, positions) for layer in range(ctx.num_layers)]


def test_rehydration_fidelity(tiny_full):  # spec §8.11
    from trtkv.runtime.tree import SearchTree

    core = _core(tiny_full)
    ids = tiny_full.encode_prompt("Make 24 from 4 9 10 13.", False)

    def tree():
        t = SearchTree(core, "p", ids, 0.0, 1.0, 0, 10, 200)
        t.start()
        t.expand(0)
        return t
    a = tree()
    node = a.nodes[1]
    span = list(range(node.start, node.start + node.n))
    before = _kv_span(node.req, span)
    node.req.evict_all_layers(span[1:-1])
    assert len(a.resident(1)) == 2
    a.rehydrate(1)
    assert a.resident(1) == list(range(node.n)) and a.rehydration_count == 1
    for (k0, v0), (k1, v1) in zip(before, _kv_span(node.req, span)):
        for x, y in ((k0, k1), (v0, v1)):
            assert float((x - y).abs().max() / y.abs().max().clamp_min(1e-6)) <= 1e-2
    a.expand(1)  # the next block on the rebuilt path (greedy) equals the one on an untouched tree
    b = tree()
    b.expand(1)
    assert a.nodes[2].token_ids == b.nodes[2].token_ids
    assert a.nodes[2].confidence == pytest.approx(b.nodes[2].confidence, abs=1e-4)
    a.close()
    b.close()
    assert core.cache.pages_in_use() == 0


def test_masking_equivalence_with_compressed_ancestor(tiny_full):  # spec §8.16
    from trtkv.runtime.tree import SearchTree

    core = _core(tiny_full)
    model = core.model
    ids = tiny_full.encode_prompt("Make 24 from 4 9 10 13.", False)
    t = SearchTree(core, "p", ids, 0.0, 1.0, 0, 10, 200)
    t.start()
    t.expand(0)
    node = t.nodes[1]
    evicted = [2, 5, node.start + 1, node.start + 3]
    node.req.evict_all_layers(evicted)  # tree-wide: shared pages lose the tokens for every sharer
    from trtkv.runtime.forking import fork_request
    from trtkv.runtime.sampling import SamplingParams, make_generator

    child = fork_request(core, node.request, SamplingParams(max_tokens=4), make_generator(0), mode="tree")
    core.decode_step([child])
    got = child.last_logits
    seq_ids = child.prompt_ids + child.generated[:1]
    L = len(seq_ids)
    with torch.inference_mode():
        pos = torch.arange(L)
        cos, sin = model.rotary.cos_sin(pos, core.dtype)
        x = model.embed(torch.tensor(seq_ids))
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        mask[L - 1, evicted] = False  # only the newest query sees the compressed cache
        for layer in range(core.arch.num_hidden_layers):
            q, k, v = model.qkv(layer, x, cos, sin)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], attn_mask=mask, scale=core.sm_scale,
                                                  enable_gqa=True)[0].transpose(0, 1)
            x = model.finish_layer(layer, x, attn)
        ref = model.logits(x[-1:])[0]
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-3)
    core.finish(child)
    t.close()
    assert core.cache.pages_in_use() == 0


# --- errors and interruption ------------------------------------------------------------------------
def test_bad_search_settings_are_one_line_errors(tiny_full):
    with pytest.raises(TrtkvError, match="branching must be a positive integer"):
        SearchConfig(branching=0).validate()
    with pytest.raises(TrtkvError, match="unknown search task"):
        get_task("chess")
    core = _core(tiny_full, "arborkv", kv_ratio=0.01)
    with pytest.raises(TrtkvError, match="below the root prompt"):
        _search(tiny_full, core)
    assert core.cache.pages_in_use() == 0


def test_interrupted_search_leaves_no_live_pages(tiny_full):
    task = get_task("game24")
    calls = []
    real = task.score

    def score(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)
    task.score = score
    core = _core(tiny_full, "arborkv", kv_ratio=0.45, k_min=2, l_tail=2)
    with pytest.raises(KeyboardInterrupt):
        run_search(core, lambda t: tiny_full.encode_prompt(t, False), task, SearchProblem.from_text("game24", PUZZLE),
                   CFG)
    assert core.cache.pages_in_use() == 0 and not core.cache.seqs and len(core.cache.refs) == 0


@pytest.mark.parametrize("policy,params", [("h2o", {"budget": 40}), ("streamingllm", {"budget": 40}),
                                           ("thinkv", {"budget": 48})])
def test_baselines_run_in_the_search(tiny_full, policy, params):  # spec §5.4: the active path is their stream
    rec = _search(tiny_full, _core(tiny_full, policy, **params))
    assert rec["expansions"] == CFG.expansions
