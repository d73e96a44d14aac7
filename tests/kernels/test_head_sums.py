"""Attention weights summed over query heads: the compiled CPU kernel equals the torch reference up to its
exponential (within 2 ulp a weight), over dead columns, dead rows and shapes of a 256 batch; the reference equals
softmax weights summed over heads; bad input is one error."""
from __future__ import annotations

import math

import pytest
import torch

from plugins.cpu_kernels.ops import head_sums_cpu
from plugins.head_sums.reference import head_sums_ref
from cpu_marks import needs_kernels


def drawn(b: int, Hq: int, n: int, seed: int):
    """Scaled logits with dead columns (-inf) and one dead row (every column -inf), and their log-sum-exps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, Hq, n, generator=g) * 4
    dead = torch.rand(b, 1, n, generator=g) < 0.25
    logits = logits.masked_fill(dead, -math.inf)
    logits[0] = -math.inf
    return logits, torch.logsumexp(logits, -1)


def test_reference_is_the_softmax_weights_summed_over_heads():
    logits, lse = drawn(5, 4, 33, seed=0)
    got = head_sums_ref(logits, lse)
    want = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0).sum(1)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[0], torch.zeros(33))  # a dead row: weights 0, not NaN


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 4, 7), (7, 9, 80), (256, 4, 72)])  # the last: a 256 batch
def test_kernel_matches_the_reference(shape):
    b, Hq, n = shape
    logits, lse = drawn(b, Hq, n, seed=sum(shape))
    want = head_sums_ref(logits, lse)
    got = head_sums_cpu(logits, lse)
    assert got.shape == (b, n) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=4 * Hq * 2 ** -23, atol=1e-30)
    assert torch.equal(got == 0, want == 0)  # dead columns are exactly 0
    op = torch.ops.trtkv.head_sums(logits, lse)  # the kernel, or the reference where another backend is forced
    assert torch.equal(op, got) or torch.equal(op, want)


@needs_kernels
def test_non_contiguous_input_reads_the_same():
    logits, lse = drawn(4, 4, 16, seed=3)
    wide = torch.full((4, 4, 20), -math.inf)
    wide[..., :16] = logits
    assert torch.equal(head_sums_cpu(wide[..., :16], lse), head_sums_cpu(logits, lse))


@needs_kernels
def test_bad_input_is_one_error():
    logits, lse = drawn(3, 4, 8, seed=0)
    with pytest.raises(RuntimeError, match="logits must be"):
        head_sums_cpu(logits[0], lse)
    with pytest.raises(RuntimeError, match="lse must be"):
        head_sums_cpu(logits, lse[:, :2])
