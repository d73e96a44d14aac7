"""Attention over the residual buffers merged into the pages' partial: compiled CPU kernel vs torch reference."""
from __future__ import annotations

import math

import pytest
import torch

import plugins.ops  # noqa: F401  (registers torch.ops.trtkv.buffer_attention)
from plugins.buffer_attention.reference import buffer_attention_ref, dense_partial
from plugins.cpu_kernels import buffer_attention_cpu
from plugins.paged_attention.reference import merge_partials
from cpu_marks import needs_kernels


def case(dtype, b=5, rows=8, L=3, g=16, H=3, G=3, D=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ak = torch.randn(rows, L, g, H, D, generator=gen).to(dtype)
    av = torch.randn(rows, L, g, H, D, generator=gen).to(dtype)
    q = torch.randn(b, H * G, D, generator=gen)
    rows_ = torch.randperm(rows, generator=gen)[:b]
    counts = torch.tensor([0, 1, g - 1, 7, g][:b])
    out = torch.randn(b, H * G, D, generator=gen)
    lse = torch.randn(b, H * G, generator=gen)
    lse[0, :2] = -math.inf  # a query with no page tokens at all
    out[0, :2] = 0.0
    return q, ak, av, rows_, counts, out, lse


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layer", [0, 2])
def test_matches_reference(dtype, layer):
    q, ak, av, rows, counts, out, lse = case(dtype)
    want_o, want_l = buffer_attention_ref(q, ak, av, rows, layer, counts, 0.125, out, lse)
    got_o, got_l = buffer_attention_cpu(q, ak, av, rows, layer, counts, 0.125, out.clone(), lse.clone())
    torch.testing.assert_close(got_o, want_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_l, want_l, atol=2e-5, rtol=1e-5)
    # a sequence with an empty buffer keeps its pages' partial bit for bit
    assert torch.equal(got_o[0, 2:], out[0, 2:]) and torch.equal(got_l[0], lse[0])


@needs_kernels
def test_buffer_only_rows_and_head_sizes():
    """No page tokens (lse -inf everywhere): the result is the buffer's own attention; D=128, G=4."""
    q, ak, av, rows, counts, out, lse = case(torch.float32, b=4, H=2, G=4, D=128, seed=3)
    counts = torch.tensor([3, 16, 1, 9])
    out.zero_()
    lse.fill_(-math.inf)
    bo, bl, _ = dense_partial(q, ak[rows, 1], av[rows, 1], counts, 0.1)
    got_o, got_l = buffer_attention_cpu(q, ak, av, rows, 1, counts, 0.1, out, lse)
    torch.testing.assert_close(got_o, bo, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_l, bl, atol=2e-5, rtol=1e-5)


def test_op_merges_in_place_like_merge_partials():
    """The registered op (compiled kernel where it builds, the torch reference otherwise) merges like
    merge_partials."""
    q, ak, av, rows, counts, out, lse = case(torch.float16, seed=5)
    want = merge_partials([(out, lse), dense_partial(q, ak[rows, 1], av[rows, 1], counts, 0.2)[:2]])
    o, s = out.clone(), lse.clone()
    torch.ops.trtkv.buffer_attention(q, ak, av, rows, 1, counts, 0.2, o, s)
    torch.testing.assert_close(o, want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s, want[1], atol=2e-5, rtol=1e-5)


@needs_kernels
def test_bad_rows_are_one_clear_error():
    q, ak, av, rows, counts, out, lse = case(torch.float32)
    with pytest.raises(RuntimeError, match="arena row out of range"):
        buffer_attention_cpu(q, ak, av, torch.tensor([0, 1, 2, 3, 99]), 0, counts, 0.1, out, lse)


def test_merge_splits_equals_merge_partials():
    """The split-axis merge (the Triton path's) equals the list merge, dead splits (lse -inf) and rows with
    nothing live anywhere included."""
    from plugins.paged_attention.reference import merge_splits

    g = torch.Generator().manual_seed(0)
    out, lse = torch.randn(3, 4, 5, 8, generator=g), torch.randn(3, 4, 5, generator=g) * 4
    lse[0, :, 1] = -math.inf
    out[0, :, 1] = 0
    lse[2] = -math.inf
    out[2] = 0
    want = merge_partials([(out[:, :, i], lse[:, :, i]) for i in range(5)])
    got = merge_splits(out, lse)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], want[1])
    assert torch.all(got[0][2] == 0) and torch.all(got[1][2] == -math.inf)
