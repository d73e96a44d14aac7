"""Gather compaction of page lists: the compiled CPU kernel leaves the pool and the outputs exactly as the torch
reference does, the reference is each list's live tokens moved to the front of its pages one by one, and bad input
is one error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from plugins.compact_slots.reference import compact_slots_ref
from plugins.cpu_kernels.ops import compact_slots_cpu
from cpu_marks import needs_kernels

FIELD_SHAPES = [((2, 4), torch.float32), ((2, 4), torch.float32), ((2, 3), torch.uint8), ((2,), torch.float16)]


def drawn(P: int, B: int, J: int, seed: int, fields: int = 2):
    """A pool of ``P`` pages (``fields`` slot fields, k_group, slot state with some slots live) and ``J`` lists of
    distinct pages; returns ``(pool tensors, pages, lens)``."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    slot_fields = [(torch.randn((P, B, *shape), generator=g) * 50).to(dtype) for shape, dtype in FIELD_SHAPES[:fields]]
    k_group = torch.from_numpy(rng.integers(-1, 9, (P, B)).astype(np.int32))
    valid = rng.integers(0, 1 << B, P).astype(np.int32) & rng.choice([0, -1], P, p=[0.2, 0.8]).astype(np.int32)
    bits = (valid[:, None] >> np.arange(B)) & 1
    live = bits.sum(1).astype(np.int32)
    hwm = np.where(live > 0, B, rng.integers(0, B + 1, P)).astype(np.int32)  # (rewritten for the lists' pages)
    slot_pos = np.where(bits > 0, rng.integers(0, 10_000, (P, B)), -1).astype(np.int64)
    slot_seg = np.where(bits > 0, rng.integers(0, 4, (P, B)), -1).astype(np.int32)
    order = rng.permutation(P)[:rng.integers(0, P + 1)]
    cuts = np.sort(rng.integers(0, len(order) + 1, J - 1)) if J > 1 else np.zeros(0, np.int64)
    lens = np.diff(np.concatenate([[0], cuts, [len(order)]])).astype(np.int64)
    pool = [slot_fields, k_group] + [torch.from_numpy(a) for a in (valid, live, hwm, slot_pos, slot_seg)]
    return pool, torch.from_numpy(order.astype(np.int64)), torch.from_numpy(lens)


def run(fn, pool, pages, lens):
    fields, k_group, *state = pool
    pool = [[t.clone() for t in fields], k_group.clone(), *(t.clone() for t in state)]
    t = int(pool[3].numpy()[pages.numpy()].sum())
    out_tokens, out_lists = torch.empty((3, t), dtype=torch.int64), torch.empty(len(lens) + 1, dtype=torch.int64)
    fn(*pool, pages, lens, out_tokens, out_lists)
    return pool, out_tokens, out_lists


def flat(pool) -> list[torch.Tensor]:
    return [*pool[0], *pool[1:]]


def test_reference_moves_each_lists_tokens_to_the_front_in_order():
    pool, pages, lens = drawn(12, 5, 3, seed=1)
    (fields, k_group, valid, live, hwm, pos, seg), tokens, lists = run(compact_slots_ref, pool, pages, lens)
    B, start, at, moved = 5, 0, 0, 0
    for j, n_pages in enumerate(lens.tolist()):
        mine = pages[start:start + n_pages].tolist()
        start += n_pages
        old = [(p, s) for p in mine for s in range(B) if (int(pool[2][p]) >> s) & 1]  # page, then slot order
        assert lists[j] == len(old)
        for k, (p, s) in enumerate(old):
            dp, ds = mine[k // B], k % B
            moved += (p, s) != (dp, ds)
            assert tokens[:, at].tolist() == [int(pool[5][p, s]), dp, ds]
            assert pos[dp, ds] == pool[5][p, s] and seg[dp, ds] == pool[6][p, s] and k_group[dp, ds] == pool[1][p, s]
            for new_f, old_f in zip(fields, pool[0]):
                assert torch.equal(new_f[dp, ds], old_f[p, s])
            at += 1
        for q, p in enumerate(mine):
            n = min(B, max(0, len(old) - q * B))
            assert (valid[p], live[p], hwm[p]) == ((1 << n) - 1, n, n)
            assert (pos[p, n:] == -1).all() and (seg[p, n:] == -1).all()
    assert at == tokens.shape[1] and 0 < lists[-1] == moved


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (6, 4, 1, 2), (40, 8, 7, 3), (300, 8, 64, 4), (64, 31, 5, 2),
                                   (3000, 8, 256, 2)])
def test_kernel_matches_the_reference(shape):
    P, B, J, fields = shape
    for seed in range(3):
        pool, pages, lens = drawn(P, B, J, seed=seed + P, fields=fields)
        want_pool, want_tokens, want_lists = run(compact_slots_ref, pool, pages, lens)
        got_pool, got_tokens, got_lists = run(compact_slots_cpu, pool, pages, lens)
        assert torch.equal(got_tokens, want_tokens) and torch.equal(got_lists, want_lists)
        for got, want in zip(flat(got_pool), flat(want_pool)):
            assert torch.equal(got, want)
        op_pool, op_tokens, op_lists = run(torch.ops.trtkv.compact_slots, pool, pages, lens)
        assert torch.equal(op_tokens, want_tokens) and all(torch.equal(a, b) for a, b in zip(flat(op_pool),
                                                                                            flat(want_pool)))


@needs_kernels
def test_bad_input_is_one_error():
    pool, pages, lens = drawn(10, 4, 2, seed=0)
    fields, k_group, valid, live, hwm, pos, seg = pool
    t = int(live.numpy()[pages.numpy()].sum())
    assert t > 0
    tokens, lists = torch.empty((3, t), dtype=torch.int64), torch.empty(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="a page out of the pool"):
        compact_slots_cpu(fields, k_group, valid, live, hwm, pos, seg, torch.tensor([0, 10]), torch.tensor([1, 1]),
                          tokens, lists)
    with pytest.raises(RuntimeError, match="add up to the pages given"):
        compact_slots_cpu(fields, k_group, valid, live, hwm, pos, seg, pages, lens + 1, tokens, lists)
    with pytest.raises(RuntimeError, match="out_tokens must be"):
        compact_slots_cpu(fields, k_group, valid, live, hwm, pos, seg, pages, lens, tokens[:, :-1].contiguous(),
                          lists)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        compact_slots_cpu(fields, k_group, valid, live, hwm, pos.int(), seg, pages, lens, tokens, lists)
