"""A batch's per-position values read from a score table: the compiled CPU kernel equals the torch reference
exactly (float32, float64, int32 tables; dead columns read 0), the reference is the table indexed entry by entry,
and bad input is one error."""
from __future__ import annotations

import pytest
import torch

from plugins.cpu_kernels.ops import gather_rows_cpu
from plugins.gather_rows.reference import gather_rows_ref
from cpu_marks import needs_kernels


def drawn(layers: int, R: int, cap: int, L: int, b: int, n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(layers, R, cap, generator=g, dtype=torch.float64) * 100).to(dtype)
    rows = torch.randperm(R, generator=g)[:b]
    positions = torch.randint(0, cap, (L, b, n), generator=g)
    positions[torch.rand(L, b, n, generator=g) < 0.2] = -1
    return data, rows, positions


def test_reference_is_the_table_entry_by_entry():
    data, rows, positions = drawn(4, 6, 30, 3, 4, 5, seed=0)
    got = gather_rows_ref(data, rows, positions, 1)
    for l_ in range(3):
        for i in range(4):
            for j in range(5):
                p = int(positions[l_, i, j])
                assert got[l_, i, j] == (data[1 + l_, rows[i], p] if p >= 0 else 0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 7), (32, 256, 72)])  # the last: 32 layers x a 256 batch
def test_kernel_matches_the_reference(shape, dtype):
    L, b, n = shape
    data, rows, positions = drawn(L + 1, b + 3, n + 20, L, b, n, seed=L + b + n, dtype=dtype)
    want = gather_rows_ref(data, rows, positions, 1)
    got = gather_rows_cpu(data, rows, positions, 1)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(torch.ops.trtkv.gather_rows(data, rows, positions, 1), want)


@needs_kernels
def test_bad_input_is_one_error():
    data, rows, positions = drawn(2, 4, 8, 2, 3, 4, seed=0)
    bad = positions.clone()
    bad[0, 1, 0] = 8
    with pytest.raises(RuntimeError, match="past the table's width"):
        gather_rows_cpu(data, rows, bad, 0)
    with pytest.raises(RuntimeError, match="layers out of the table"):
        gather_rows_cpu(data, rows, positions, 1)
    with pytest.raises(RuntimeError, match="a row out of the table"):
        gather_rows_cpu(data, torch.tensor([0, 1, 9]), positions, 0)
