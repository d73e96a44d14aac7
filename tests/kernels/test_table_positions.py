"""The token positions behind a layer's paged-attention columns and each row's held count: the compiled CPU kernel
equals the torch reference exactly (int32 and int64 block tables, -1 padded), the reference is the pool read entry by
entry, every layer's read at once (``table_positions_layers``) is each layer's own, and bad input is one error."""
from __future__ import annotations

import pytest
import torch

from plugins.cpu_kernels.ops import table_positions_cpu, table_positions_layers_cpu
from plugins.table_positions.reference import table_positions_layers_ref, table_positions_ref
from cpu_marks import needs_kernels


def drawn(cap: int, B: int, b: int, P: int, seed: int, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    slot_pos = torch.randint(-1, 5000, (cap, B), generator=g)
    bt = torch.randint(0, cap, (b, P), generator=g)
    bt[torch.rand(b, P, generator=g) < 0.2] = -1
    return slot_pos, bt.to(dtype)


def test_reference_is_the_pool_entry_by_entry():
    slot_pos, bt = drawn(9, 4, 3, 5, seed=0)
    got, counts = table_positions_ref(slot_pos, bt)
    assert got.shape == (3, 20) and got.dtype == torch.int64 and counts.dtype == torch.int64
    for i in range(3):
        held = 0
        for p in range(5):
            for s in range(4):
                page = int(bt[i, p])
                assert got[i, p * 4 + s] == (slot_pos[page, s] if page >= 0 else -1)
                held += page >= 0 and slot_pos[page, s] >= 0
        assert counts[i] == held


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (7, 4, 3, 2), (4096, 16, 256, 6), (10, 8, 0, 3), (10, 8, 4, 0)])
def test_kernel_matches_the_reference(shape, dtype):
    cap, B, b, P = shape
    slot_pos, bt = drawn(cap, B, b, P, seed=sum(shape), dtype=dtype)
    want, want_counts = table_positions_ref(slot_pos, bt)
    got, counts = table_positions_cpu(slot_pos, bt)
    assert got.dtype == torch.int64 and got.shape == (b, P * B) and torch.equal(got, want)
    assert counts.dtype == torch.int64 and torch.equal(counts, want_counts)
    for out in (torch.ops.trtkv.table_positions(slot_pos, bt), table_positions_cpu(slot_pos, bt.t().contiguous().t())):
        assert torch.equal(out[0], want) and torch.equal(out[1], want_counts)  # the op; a strided table


@needs_kernels
def test_bad_input_is_one_error():
    slot_pos, bt = drawn(6, 4, 3, 2, seed=0)
    bad = bt.clone()
    bad[1, 1] = 6
    with pytest.raises(RuntimeError, match="a page past the pool"):
        table_positions_cpu(slot_pos, bad)
    with pytest.raises(RuntimeError, match="int64"):
        table_positions_cpu(slot_pos.int(), bt)
    with pytest.raises(RuntimeError, match=r"int32 or int64 \[b, P\]"):
        table_positions_cpu(slot_pos, bt.float())


def drawn_layers(L: int, cap: int, B: int, b: int, P: int, seed: int, dtype=torch.int32):
    layers = [drawn(cap, B, b, P, seed + layer, dtype) for layer in range(L)]
    return torch.stack([sp for sp, _ in layers]), [bt for _, bt in layers]


def test_layers_reference_is_each_layers_read():
    slot_pos, tables = drawn_layers(3, 9, 4, 5, 2, seed=1)
    got, counts = table_positions_layers_ref(slot_pos, tables)
    assert got.shape == (3, 5, 8) and counts.shape == (3, 5)
    for layer in range(3):
        want, want_counts = table_positions_ref(slot_pos[layer], tables[layer])
        assert torch.equal(got[layer], want) and torch.equal(counts[layer], want_counts)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (3, 7, 4, 3, 2), (32, 600, 8, 256, 5), (4, 10, 8, 0, 3)])
def test_layers_kernel_matches_the_reference(shape, dtype):
    slot_pos, tables = drawn_layers(*shape, seed=sum(shape), dtype=dtype)
    want, want_counts = table_positions_layers_ref(slot_pos, tables)
    for got, counts in (table_positions_layers_cpu(slot_pos, tables),
                        torch.ops.trtkv.table_positions_layers(slot_pos, tables)):
        assert got.dtype == torch.int64 and torch.equal(got, want) and torch.equal(counts, want_counts)


@needs_kernels
def test_layers_bad_input_is_one_error():
    slot_pos, tables = drawn_layers(3, 6, 4, 3, 2, seed=0)
    bad = [t.clone() for t in tables]
    bad[2][1, 1] = 6  # (a page of the next layer's pool, were the layers one array)
    with pytest.raises(RuntimeError, match="a page past the pool"):
        table_positions_layers_cpu(slot_pos, bad)
    with pytest.raises(RuntimeError, match="one block table a layer"):
        table_positions_layers_cpu(slot_pos, tables[:2])
    with pytest.raises(RuntimeError, match="all of one shape and type"):
        table_positions_layers_cpu(slot_pos, [tables[0], tables[1][:2], tables[2]])
    with pytest.raises(RuntimeError, match="all of one shape and type"):
        table_positions_layers_cpu(slot_pos, [tables[0], tables[1].long(), tables[2]])
