"""The lowest-scored unprotected position per row read from a score table: the reference is ``gather_rows`` +
``lowest_victim`` with the bound as the protection, spelled out in plain Python; the compiled CPU kernel returns
the reference's victims exactly (float32 and float64 tables, ties, NaNs, infinities, positions past the table's
width, rows with nothing free, any layer offset); bad input is one error."""
from __future__ import annotations

import pytest
import torch

import plugins.ops as plugin_ops
from plugins.cpu_kernels.ops import table_victims_cpu
from plugins.table_victims.reference import table_victims_ref
from cpu_marks import needs_kernels

INF, NAN = float("inf"), float("nan")


def drawn(Lt: int, R: int, cap: int, L: int, k: int, c: int, seed: int, dtype=torch.float32):
    """A score table of a few values (ties) with some NaN and infinite, distinct rows, shuffled held positions
    (some -1, some past the width: never written) and bounds that protect a share of each row."""
    g = torch.Generator().manual_seed(seed)
    data = (torch.randint(0, 5, (Lt, R, cap), generator=g).to(dtype) / 4)
    special = torch.rand(Lt, R, cap, generator=g)
    data[special < 0.03] = NAN
    data[(special >= 0.03) & (special < 0.06)] = INF
    data[(special >= 0.06) & (special < 0.07)] = -INF
    rows = torch.randperm(R, generator=g)[:k]
    positions = torch.full((L, k, c), -1, dtype=torch.int64)
    for li in range(L):
        for i in range(k):
            positions[li, i] = torch.randperm(cap + 8, generator=g)[:c]
    positions[torch.rand(L, k, c, generator=g) < 0.15] = -1
    bound = torch.randint(0, cap + 8, (k,), generator=g)
    bound[: k // 5] = 0  # rows with nothing free
    return data, rows, positions, bound


def oracle(data, rows, positions, bound, layer0) -> list[list[int]]:
    """The contract in plain Python: per layer and row, the first minimum (as float32) over the free positions in
    ascending order, a position past the width scoring 0."""
    out = []
    for li, layer_pos in enumerate(positions.tolist()):
        got = []
        for i, cols in enumerate(layer_pos):
            table = data[layer0 + li, int(rows[i])]
            free = sorted((p, float(table[p].float()) if p < table.shape[0] else 0.0) for p in cols
                          if 0 <= p < int(bound[i]))
            nans = [p for p, v in free if v != v]
            best = min(free, key=lambda t: t[1], default=None)
            got.append(nans[0] if nans else -1 if best is None or abs(best[1]) == INF else best[0])
        out.append(got)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layer0", [0, 1])
def test_reference_is_the_first_minimum_over_free_positions(seed, layer0):
    data, rows, positions, bound = drawn(4, 9, 20, 3, 7, 12, seed)
    assert table_victims_ref(data, rows, positions, bound, layer0).tolist() == \
        oracle(data, rows, positions, bound, layer0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 1), (4, 9, 20, 3, 7, 12), (32, 300, 160, 32, 256, 80),
                                   (2, 3, 8, 2, 0, 4), (2, 3, 8, 2, 3, 0)])
def test_kernel_matches_the_reference(shape, dtype):
    Lt = shape[0]
    for layer0 in sorted({0, Lt - shape[3]}):
        data, rows, positions, bound = drawn(*shape, seed=sum(shape) + layer0, dtype=dtype)
        want = table_victims_ref(data, rows, positions, bound, layer0)
        for got in (table_victims_cpu(data, rows, positions, bound, layer0),
                    plugin_ops.table_victims(data, rows, positions, bound, layer0),
                    torch.ops.trtkv.table_victims(data, rows, positions, bound, layer0)):
            assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)


@needs_kernels
def test_bad_input_is_one_error():
    data, rows, positions, bound = drawn(2, 4, 8, 2, 3, 5, seed=0)
    with pytest.raises(RuntimeError, match="one per row"):
        table_victims_cpu(data, rows, positions, bound[:2], 0)
    with pytest.raises(RuntimeError, match="layers out of the table"):
        table_victims_cpu(data, rows, positions, bound, 1)
    with pytest.raises(RuntimeError, match="a row out of the table"):
        table_victims_cpu(data, torch.tensor([0, 1, 4]), positions, bound, 0)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        table_victims_cpu(data.half(), rows, positions, bound, 0)
