"""The per-index updates equal numpy's ``ufunc.at`` on drawn indices with repeats, short lists and long; a batch's
byte charges equal one ``add`` each; the runs of a sorted array equal ``np.unique``'s counts."""
from __future__ import annotations

import numpy as np
import pytest

from trtkv.cache.accounting import ByteAccount
from trtkv.cache.index_ops import add_at, clear_at, max_at, or_at, sorted_runs, split_counts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [0, 5, 64, 65, 3000])
def test_grouped_updates_equal_ufunc_at(seed, n):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 200))
    idx = rng.integers(0, size, n)
    base = rng.integers(-1000, 1000, size).astype(np.int32)
    bits = np.left_shift(np.int32(1), rng.integers(0, 31, n).astype(np.int32))
    vals = rng.integers(-50, 50, n).astype(np.int32)
    for ours, theirs, arg in ((add_at, np.add.at, -1), (add_at, np.add.at, vals.astype(np.int64)),
                              (or_at, np.bitwise_or.at, bits), (max_at, np.maximum.at, vals)):
        a, b = base.copy(), base.copy()
        ours(a, idx, arg)
        theirs(b, idx, arg)
        assert np.array_equal(a, b) and a.dtype == b.dtype
    a, b = base.copy(), base.copy()
    clear_at(a, idx, bits)
    np.bitwise_and.at(b, idx, ~bits)
    assert np.array_equal(a, b)


def test_split_counts_is_np_split_by_lengths():
    a = np.arange(20) * 3
    for counts in ([20], [0, 5, 0, 15], [1] * 20, [7, 13], [0]):
        if sum(counts) != len(a):
            a = np.arange(sum(counts))
        got = split_counts(a, counts)
        want = np.split(a, np.cumsum(counts)[:-1])
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("seed", range(4))
def test_byte_account_add_each_is_add_of_each(seed):
    """A batch's charges in one loop leave every account's bytes and peak as ``add`` of each in turn would, with
    one amount for all (a numpy integer too) or one each, up and down."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, 1000, 6).tolist()
    one, each = [ByteAccount(s) for s in start], [ByteAccount(s) for s in start]
    for _ in range(5):
        amounts = rng.integers(-300, 300, 6)
        ByteAccount.add_each(one, amounts.tolist())
        for a, n in zip(each, amounts.tolist()):
            a.add(n)
        same = rng.integers(-300, 300)
        ByteAccount.add_each(one[::2], same)
        for a in each[::2]:
            a.add(int(same))
    assert [(a.bytes, a.peak) for a in one] == [(a.bytes, a.peak) for a in each]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [0, 1, 7, 500])
def test_sorted_runs_equal_unique_counts(seed, n):
    a = np.sort(np.random.default_rng(seed).integers(0, max(1, n // 3), n))
    values, counts = sorted_runs(a)
    want_values, want_counts = np.unique(a, return_counts=True)
    assert np.array_equal(values, want_values) and np.array_equal(counts, want_counts)
