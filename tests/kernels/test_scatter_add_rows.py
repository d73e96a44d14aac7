"""A batch's per-position evidence added into a score table: the compiled CPU kernel leaves the torch reference's
table exactly, over drawn rows, layers, skipped (-1) columns and value dtypes; a bad position is one error. The
evidence's finite rows: the kernel says what the reference says."""
from __future__ import annotations

import pytest
import torch

import plugins.ops as plugin_ops
from plugins.backend import use_cpu_kernels
from plugins.cpu_kernels.ops import finite_rows_cpu, fold_add_rows_cpu, scatter_add_rows_cpu
from plugins.scatter_add_rows.reference import finite_rows_ref, fold_add_rows_ref, scatter_add_rows_ref
from cpu_marks import needs_kernels


def drawn(layers: int, R: int, cap: int, L: int, b: int, n: int, seed: int, dtype=torch.float32,
          table=torch.float32):
    """A table with history, ``b`` distinct rows, and per (layer, row) ``n`` distinct positions, some skipped."""
    g = torch.Generator().manual_seed(seed)
    data = torch.rand(layers, R, cap, generator=g, dtype=torch.float64).to(table)
    rows = torch.randperm(R, generator=g)[:b]
    positions = torch.stack([torch.stack([torch.randperm(cap, generator=g)[:n] for _ in range(b)])
                             for _ in range(L)])
    positions[torch.rand(L, b, n, generator=g) < 0.2] = -1
    values = torch.rand(L, b, n, generator=g).to(dtype)
    return data, rows, positions, values


def test_reference_adds_each_value_once():
    data = torch.zeros(2, 3, 5)
    scatter_add_rows_ref(data, torch.tensor([2, 0]), torch.tensor([[[4, -1], [0, 1]]]),
                         torch.tensor([[[1.5, 9.0], [2.0, 3.0]]]), 1)
    want = torch.zeros(2, 3, 5)
    want[1, 2, 4], want[1, 0, 0], want[1, 0, 1] = 1.5, 2.0, 3.0
    assert torch.equal(data, want)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (32, 256, 64)])  # the last: r1-llama-8b's depth x 256
@pytest.mark.parametrize("layer0", [0, 2])
@pytest.mark.parametrize("dtype,table", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                         (torch.float64, torch.float64)])  # (the last: tiered's fp64 score sums)
def test_kernel_matches_the_reference(shape, layer0, dtype, table):
    L, b, n = shape
    data, rows, positions, values = drawn(L + layer0, b + 3, n + 40, L, b, n, seed=L + b + n + layer0, dtype=dtype,
                                          table=table)
    want = data.clone()
    scatter_add_rows_ref(want, rows, positions, values, layer0)
    got = data.clone()
    scatter_add_rows_cpu(got, rows, positions, values, layer0)
    assert torch.equal(got, want)
    via_op = data.clone()
    torch.ops.trtkv.scatter_add_rows(via_op, rows, positions, values, layer0)
    assert torch.equal(via_op, want)


@needs_kernels
def test_a_position_past_the_width_is_one_error():
    data, rows, positions, values = drawn(2, 4, 8, 2, 3, 4, seed=0)
    positions[1, 2, 0] = 8
    with pytest.raises(RuntimeError, match="past the table's width"):
        scatter_add_rows_cpu(data, rows, positions, values, 0)
    with pytest.raises(RuntimeError, match="layers out of the table"):
        scatter_add_rows_cpu(data, rows, positions.clamp(max=7), values, 1)


def test_entry_point_runs_the_reference_for_other_tables():
    """A float64 table (or one off the CPU kernels) takes the reference: the same adds."""
    data, rows, positions, values = drawn(2, 6, 12, 2, 4, 5, seed=1)
    data = data.double()
    want = data.clone()
    scatter_add_rows_ref(want, rows, positions, values, 0)
    plugin_ops.scatter_add_rows(data, rows, positions, values, 0)
    assert torch.equal(data, want)


def test_fold_reference_adds_layer_by_layer():
    """Every layer's quotients into one layer, in layer order: what one add_rows call a layer adds."""
    data, rows, positions, values = drawn(2, 5, 9, 3, 3, 4, seed=3, table=torch.float64)
    positions[:, :, 0] = 2  # a position every layer holds: summed in layer order
    divisor = torch.tensor([1.0, 3.0, 7.0], dtype=torch.float64)
    want = data.clone()
    for li in range(3):
        scatter_add_rows_ref(want, rows, positions[li:li + 1], (values[li].double() / divisor[:, None])[None], 1)
    got = data.clone()
    fold_add_rows_ref(got, rows, list(positions), list(values), divisor, 1)
    assert torch.equal(got, want)


def fold_batch(L: int, b: int, n: int, seed: int, dtype, table):
    """``drawn``'s batch as one ``[b, n_l]`` array a layer, the layers of different widths, one position held by
    every layer of each row (the adds that order decides)."""
    data, rows, positions, values = drawn(2, b + 3, n + 40, L, b, n, seed=seed, dtype=dtype, table=table)
    positions[:, :, :1] = positions[:1, :, :1]
    widths = [max(1, n - li % 3) for li in range(L)]
    return data, rows, [positions[li, :, :w] for li, w in enumerate(widths)], \
        [values[li, :, :w] for li, w in enumerate(widths)]


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (32, 256, 64)])
@pytest.mark.parametrize("dtype,table", [(torch.float32, torch.float64), (torch.float32, torch.float32),
                                         (torch.bfloat16, torch.float64), (torch.float64, torch.float64)])
def test_fold_kernel_matches_the_reference(shape, dtype, table):
    L, b, n = shape
    data, rows, positions, values = fold_batch(L, b, n, L + b + n, dtype, table)
    divisor = torch.arange(1, b + 1, dtype=torch.float64) * 3
    want = data.clone()
    fold_add_rows_ref(want, rows, positions, values, divisor, 1)
    got = data.clone()
    fold_add_rows_cpu(got, rows, positions, values, divisor, 1)
    assert torch.equal(got, want)
    via_op = data.clone()
    torch.ops.trtkv.fold_add_rows(via_op, rows, positions, values, divisor, 1)
    assert torch.equal(via_op, want)
    if L == 32 and table == torch.float32:  # (order matters: the layers added backwards leave another table)
        backwards = data.clone()
        fold_add_rows_cpu(backwards, rows, positions[::-1], values[::-1], divisor, 1)
        assert not torch.equal(backwards, want)


@needs_kernels
def test_fold_bad_position_or_layer_is_one_error():
    data, rows, positions, values = fold_batch(2, 3, 4, 0, torch.float32, torch.float32)
    divisor = torch.ones(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="layer out of the table"):
        fold_add_rows_cpu(data, rows, positions, values, divisor, 2)
    positions[1][2, 0] = data.shape[2]
    with pytest.raises(RuntimeError, match="past the table's width"):
        fold_add_rows_cpu(data, rows, positions, values, divisor, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_finite_rows_finds_every_infinity_and_nan(dtype):
    """Each kind of non-finite value, first, last or inside a row of blocks of different widths (one empty), is
    found by the kernel and the reference alike; every other row is finite."""
    g = torch.Generator().manual_seed(5)
    blocks = [torch.rand(6, n, generator=g).to(dtype) * 1e3 for n in (1, 17, 0, 33, 64)]
    bad = {(0, 2): float("inf"), (1, 0): -float("inf"), (1, 5): float("nan"), (3, 5): float("nan"),
           (4, 0): -float("inf")}
    for (blk, row), x in bad.items():
        col = {0: 0, 1: -1, 3: 16, 4: 63}[blk]
        blocks[blk][row, col] = x
    want = torch.ones(5, 6, dtype=torch.bool)
    for blk, row in bad:
        want[blk, row] = False
    assert torch.equal(finite_rows_ref(blocks), want)
    assert torch.equal(plugin_ops.finite_rows(blocks), want)
    assert torch.equal(torch.ops.trtkv.finite_rows(blocks), want)
    if use_cpu_kernels(blocks[0]):
        assert torch.equal(finite_rows_cpu(blocks), want)


@needs_kernels
def test_finite_rows_kernel_on_a_batch_of_layers():
    """r1-llama-8b's depth x 256 rows, two blocks a layer, a few values poisoned: the reference's answer."""
    g = torch.Generator().manual_seed(6)
    blocks = [torch.rand(256, 60 + li % 7, generator=g) for li in range(64)]
    for i in torch.randint(0, 64 * 256, (40,), generator=g).tolist():
        blk, row = divmod(i, 256)
        blocks[blk][row, row % blocks[blk].shape[1]] = float("nan") if row % 2 else float("inf")
    want = finite_rows_ref(blocks)
    assert (~want).sum() > 30
    assert torch.equal(finite_rows_cpu(blocks), want)
