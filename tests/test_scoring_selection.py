"""Selection helpers of the scoring policies (trtkv/policies/scoring.py): membership by binary search equals
``np.isin``, and the scored policies' one-victim shortcut evicts what keeping the top n-1 leaves out."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trtkv.policies.scoring import PositionTable, lookup, lowest, pool1d, sorted_member, top_keep
from trtkv.runtime.attention import live_first, live_views


@pytest.mark.parametrize("seed", range(20))
def test_sorted_member_equals_isin(seed):
    rng = np.random.default_rng(seed)
    a = np.sort(rng.choice(200, rng.integers(0, 60), replace=False))
    b = np.sort(rng.integers(0, 220, rng.integers(0, 30)))  # duplicates and values beyond a's range
    assert np.array_equal(sorted_member(a, b), np.isin(a, b))


@pytest.mark.parametrize("seed", range(30))
def test_argmin_victim_is_what_top_keep_leaves_out(seed):
    """ScorerPolicy.evict_layer's shortcut: with one victim, ``cand[argmin(scores)]`` over ascending
    candidates equals the complement of ``top_keep(n - 1)`` — ties (and NaN) included."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 40))
    cand = np.sort(rng.choice(500, n, replace=False))
    scores = torch.tensor(rng.integers(0, 4, n), dtype=torch.float32)  # many ties
    if seed % 5 == 0:
        scores[rng.integers(0, n, 2)] = float("nan")
    keep = top_keep(cand, scores, n - 1)
    victim = cand[int(torch.argmin(scores))]
    assert np.array_equal(np.setdiff1d(cand, keep), [victim])
    assert cand[int(np.argmin(scores.numpy()))] == victim  # numpy scores (TOVA's lookup) take the same path
    if not torch.isnan(scores).any():
        assert lowest(cand, scores, 1).tolist() == [victim]


def test_batch_row_stats_equals_row_stats_per_request():
    """The batch's statistics in one set of tensor ops equal each request's own (dead slots and a row with no
    live key included); without sparsity only the weights come back."""
    from trtkv.runtime.attention import batch_row_stats, row_stats

    torch.manual_seed(0)
    logits = torch.randn(4, 6, 50) * 3
    logits[:, :, 7:12] = -float("inf")
    logits[2] = -float("inf")
    lse = torch.logsumexp(logits, -1)
    w, sh, u = batch_row_stats(logits, lse, 2)
    for i in range(4):
        w1, sh1, u1 = row_stats(logits[i], lse[i], 2)
        assert torch.equal(w[i], w1) and torch.equal(sh[i], sh1) and float(u[i]) == u1
    assert torch.equal(w[2], torch.zeros(6, 50))
    w2, none_h, none_u = batch_row_stats(logits, lse, 2, sparsity=False)
    assert torch.equal(w2, w) and none_h is None and none_u is None


@pytest.mark.parametrize("T,window,Hq,H", [(24, 8, 4, 2), (5, 8, 4, 4), (40, 1, 6, 2)])
def test_prefill_stats_of_many_prompts_equal_each_prompts_own(T, window, Hq, H):
    """A packed prefill's statistics of prompts of one length, in one batched call, equal (bit for bit) each
    prompt's computed alone by the one-prompt formula: the window's weights over the prompt (causal), the last
    query's logits and its sparsity statistics."""
    import math

    from trtkv.runtime.attention import prefill_stats_many, row_stats

    torch.manual_seed(T)
    b, D, scale = 5, 16, 0.25
    q, k = torch.randn(b, T, Hq, D) * 2, torch.randn(b, T, H, D)
    got = prefill_stats_many(q, k, window, scale)
    w = min(window, T)
    for i in range(b):  # (the one-prompt formula, written out)
        logits = torch.einsum("whgd,thd->whgt", q[i, T - w:].reshape(w, H, Hq // H, D), k[i]) * scale
        causal = torch.arange(T)[None, :] > torch.arange(T - w, T)[:, None]
        logits = logits.masked_fill(causal[:, None, None, :], -math.inf).reshape(w, Hq, T)
        _, sh, u = row_stats(logits[-1], torch.logsumexp(logits[-1], -1), H)
        assert torch.equal(got[i].weights, torch.softmax(logits, -1)) and torch.equal(got[i].logits, logits[-1])
        assert torch.equal(got[i].sparsity_heads, sh) and got[i].sparsity == u
        assert got[i].positions.tolist() == list(range(T))


@pytest.mark.parametrize("seed", range(6))
def test_lookup_dense_table_equals_sorted_search(seed, monkeypatch):
    """The dense position table and the sorted search (forced by a zero span) read the same values."""
    import trtkv.policies.scoring as scoring

    rng = np.random.default_rng(seed)
    for n in (0, 1, 7, 300):
        pos = rng.choice(5000 if seed % 2 else 400, size=n, replace=False)
        vals = torch.rand(n, generator=torch.Generator().manual_seed(seed))
        query = rng.integers(0, 5000, size=64)
        query[: min(n, 20)] = pos[:20]
        dense = lookup(pos, vals, default=-1.0)(query)
        monkeypatch.setattr(scoring, "DENSE_LOOKUP_SPAN", -10**9)
        searched = lookup(pos, vals, default=-1.0)(query)
        monkeypatch.undo()
        assert dense.dtype == searched.dtype and np.array_equal(dense, searched)


def test_position_table_add_layers_matches_add():
    """One scatter for every layer's statistics lands exactly where per-layer ``add`` calls do, growing
    the table past its capacity on the way."""
    rng = np.random.default_rng(0)
    one, many = PositionTable(4), PositionTable(4)
    for step in range(3):
        items = [(layer, rng.choice(50 + 40 * step, 12 + layer, replace=False), torch.rand(12 + layer))
                 for layer in (0, 2, 3)]
        for layer, pos, val in items:
            one.add(layer, pos, val)
        many.add_layers(items)
    assert torch.equal(one.data, many.data)


def test_live_first_views_keep_each_rows_live_columns_in_slot_order():
    pos = np.array([[5, -1, 7, 2], [-1, -1, 9, 1], [3, 4, 6, 8]])
    w = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    p2, w2, lg2, s2, counts = live_first(pos, w, -w, w.sum(1))
    assert counts == [3, 2, 4]
    for i, (rw, rl, rs) in enumerate(zip(live_views(w2, counts), live_views(lg2, counts), live_views(s2, counts))):
        cols = np.flatnonzero(pos[i] >= 0)
        assert p2[i, :counts[i]].tolist() == pos[i, cols].tolist()
        assert torch.equal(rw, w[i][:, cols]) and torch.equal(rl, -w[i][:, cols])
        assert torch.equal(rs, w[i].sum(0)[cols])


@pytest.mark.parametrize("seed", range(4))
def test_avg_pool1d_is_torchs_bit_for_bit(seed):
    """pool1d's shifted adds give F.avg_pool1d's bits (zero padding, divided by the kernel): the policies that pool
    (AMS, SnapKV) keep their golden tokens."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(60):
        kernel, T, b = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 12), (1, 300), (1, 40)))
        x = torch.softmax(torch.randn(b, 3, T, generator=g) * 5, -1) if seed % 2 else \
            torch.rand(b, 3, T, generator=g) * 10 ** float(torch.randint(-8, 8, (1,), generator=g))
        left, right = (kernel - 1) // 2, kernel // 2
        want = torch.nn.functional.avg_pool1d(torch.nn.functional.pad(x.reshape(-1, 1, T), (left, right)), kernel,
                                              stride=1).reshape(b, 3, T)
        assert torch.equal(pool1d(x, kernel, "avg"), want)
