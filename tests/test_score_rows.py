"""``RowTable`` / ``RowView``: per-position values of many requests in one tensor, read and written by row
(the per-request verbs) or for a batch (flat indices), growing on demand whichever verb comes first."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from trtkv.policies.score_rows import FIRST_CAP, RowTable


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_batch_verbs_equal_row_verbs(dtype):
    rng = np.random.default_rng(0)
    table = RowTable(3, dtype=dtype)
    views = [table.acquire() for _ in range(5)]
    rows = np.array([v.row for v in views])
    pos = np.stack([rng.permutation(3 * FIRST_CAP)[:7] for _ in views])  # past the first width: grows
    vals = torch.from_numpy(rng.integers(1, 9, pos.shape)).to(dtype)
    flat = table.flat(rows, pos)
    table.put(2, flat.reshape(-1), vals.reshape(-1))
    for i, v in enumerate(views):
        assert torch.equal(v.get(2, pos[i]), vals[i])
        assert not v.get(1, pos[i]).any()  # other layers untouched
    assert torch.equal(table.take(2, table.flat(rows, pos).reshape(-1)).view(pos.shape), vals)
    assert torch.equal(table.get_rows(2, rows, pos), vals)


def test_get_past_the_width_grows_first_and_reads_zero():
    table = RowTable(2)
    view = table.acquire()
    view.add(0, [3], torch.tensor([1.5]))
    far = np.array([5, 10 * FIRST_CAP])
    assert view.get(0, far).tolist() == [0.0, 0.0] and table.cap > 10 * FIRST_CAP
    assert view.get(0, [3]).tolist() == [1.5]


def test_rows_are_reused_zeroed_and_copies_are_independent():
    table = RowTable(1)
    a = table.acquire()
    a.set(0, [1, 2], torch.tensor([4.0, 5.0]))
    twin = copy.deepcopy(a)
    assert twin.row != a.row and twin.get(0, [1, 2]).tolist() == [4.0, 5.0]
    twin.add(0, [1], torch.tensor([1.0]))
    assert a.get(0, [1]).tolist() == [4.0]
    row = a.row
    a.release()
    b = table.acquire()
    assert b.row == row and not b.values(0).any()


@pytest.mark.parametrize("seed", range(5))
def test_every_layer_verbs_equal_per_layer_verbs(seed):
    """``add_rows_layers`` / ``get_rows_layers`` (one scatter / gather for every layer) equal ``add_rows`` /
    ``get_rows`` layer by layer, skipped (-1) columns and growth past the width included."""
    rng = np.random.default_rng(seed)
    L, b, n = 3, 5, 7
    stacked, each = RowTable(L), RowTable(L)
    rows = np.array([each.acquire().row for _ in range(b)])
    assert [stacked.acquire().row for _ in range(b)] == rows.tolist()
    for _ in range(4):
        pos = np.stack([[rng.permutation(FIRST_CAP + 40)[:n] for _ in range(b)] for _ in range(L)])
        pos[rng.random(pos.shape) < 0.2] = -1
        vals = torch.rand(L, b, n)
        stacked.add_rows_layers(rows, pos, vals)
        for layer in range(L):
            each.add_rows(layer, rows, pos[layer], vals[layer])
        q = np.maximum(pos, 0)
        assert torch.equal(stacked.get_rows_layers(rows, q),
                           torch.stack([each.get_rows(layer, rows, q[layer]) for layer in range(L)]))
    assert torch.equal(stacked.data[:, 1:], each.data[:, 1:])  # (row 0: the scratch row, never handed out)


@pytest.mark.parametrize("same_mask", [True, False])
@pytest.mark.parametrize("same_step", [True, False])
def test_random_scores_of_every_layer_equal_layer_by_layer(same_mask, same_step):
    """RandomScorer's all-layer read (one draw per layer for the batch) equals its ``score_rows`` layer by layer."""
    from trtkv.policies.random import RandomScorer
    from trtkv.policies.scorers import Scorer

    rng = np.random.default_rng(3)
    L, k, n = 4, 5, 9
    steps = np.full(k, 7, np.int64) if same_step else rng.integers(0, 3, k)
    positions = np.sort(rng.choice(50, (L, k, n)), axis=2)
    free = np.broadcast_to(rng.random(n) < 0.7, (L, k, n)).copy() if same_mask else rng.random((L, k, n)) < 0.7
    scorer = RandomScorer(seed=5)
    got = scorer.score_rows_layers(steps, positions, free)
    want = Scorer.score_rows_layers(scorer, steps, positions, free)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernels", [True, False])
def test_every_layer_read_past_the_width_grows_and_reads_zero(monkeypatch, kernels):
    """``get_rows_layers`` reads first and grows only when a position is past the width (the compiled kernel's
    check and the reference's alike): the values are the same as growing first; ``add_rows_layers`` grows to the
    bound it is given."""
    if not kernels:
        monkeypatch.setenv("TRTKV_KERNELS", "reference")
    table = RowTable(2)
    rows = np.array([table.acquire().row for _ in range(2)])
    pos = np.array([[[1, 3]], [[2, 5]]]).repeat(2, axis=1)  # [L, b, n]
    table.add_rows_layers(rows, pos, torch.ones(2, 2, 2), top=3 * FIRST_CAP)
    assert table.cap > 3 * FIRST_CAP
    far = pos.copy()
    far[1, 1, 1] = 10 * FIRST_CAP
    got = table.get_rows_layers(rows, far)
    assert table.cap > 10 * FIRST_CAP
    want = torch.ones(2, 2, 2)
    want[1, 1, 1] = 0
    assert torch.equal(got, want)
