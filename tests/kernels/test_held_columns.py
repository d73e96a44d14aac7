"""The held columns of a batch's position-map rows: the compiled CPU kernel equals the torch reference exactly, the
reference is each row scanned in order, and bad input (a row holding another count, a row out of the map) is one
error."""
from __future__ import annotations

import pytest
import torch

from plugins.cpu_kernels.ops import held_columns_cpu
from plugins.held_columns.reference import held_columns_ref
from cpu_marks import needs_kernels


def drawn(L: int, R: int, W: int, k: int, n: int, seed: int):
    """A map whose every row holds exactly ``n`` of ``W`` columns (codes >= 0; -1 and other negatives not held)."""
    g = torch.Generator().manual_seed(seed)
    where = torch.full((L, R, W), -1, dtype=torch.int32)
    for l_ in range(L):
        for r in range(R):
            cols = torch.randperm(W, generator=g)[:n]
            where[l_, r, cols] = torch.randint(0, 1 << 20, (n,), generator=g, dtype=torch.int32)
    where[where < 0] = torch.randint(-5, 0, (int((where < 0).sum()),), generator=g, dtype=torch.int32)
    rows = torch.randperm(R, generator=g)[:k]
    return where, rows


def test_reference_is_each_row_scanned_in_order():
    where, rows = drawn(3, 5, 12, 4, 5, seed=0)
    got = held_columns_ref(where, rows, 5)
    assert got.shape == (3, 4, 5) and got.dtype == torch.int64
    for l_ in range(3):
        for i in range(4):
            assert got[l_, i].tolist() == [j for j in range(12) if where[l_, rows[i], j] >= 0]


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 6, 9, 4, 0), (3, 7, 40, 5, 40), (32, 260, 192, 256, 64)])
def test_kernel_matches_the_reference(shape):
    L, R, W, k, n = shape
    where, rows = drawn(L, R, W, k, n, seed=sum(shape))
    want = held_columns_ref(where, rows, n)
    got = held_columns_cpu(where, rows, n)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(torch.ops.trtkv.held_columns(where, rows, n), want)


@needs_kernels
def test_bad_input_is_one_error():
    where, rows = drawn(2, 4, 8, 3, 3, seed=0)
    with pytest.raises(RuntimeError, match="holds other than 2 columns"):
        held_columns_cpu(where, rows, 2)
    with pytest.raises(ValueError, match="holds other than 2 columns"):
        held_columns_ref(where, rows, 2)
    with pytest.raises(RuntimeError, match="a row out of the map"):
        held_columns_cpu(where, torch.tensor([0, 4]), 3)
    with pytest.raises(RuntimeError, match="contiguous int32"):
        held_columns_cpu(where.long(), rows, 3)
