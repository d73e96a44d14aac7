"""int8 weight-only linear: the compiled CPU kernel equals the torch reference to rounding for every row count
it takes (tails of rows and of 64-channel blocks included), and ``plugins.ops.int8_linear`` gives many rows to
the reference's dense GEMM."""
from __future__ import annotations

import pytest
import torch

import plugins.ops as plugin_ops
from cpu_marks import needs_kernels
from plugins.cpu_kernels.ops import int8_linear_cpu
from plugins.int8_linear.reference import Int8Weight, block_codes, int8_linear_ref, unblock_codes


def case(M: int, N: int, K: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen)
    scales = w.abs().amax(1) / 127
    codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return torch.randn(M, K, generator=gen) * 3, Int8Weight.pack(codes, scales), codes, scales


@pytest.mark.parametrize("N,K", [(64, 64), (100, 33), (960, 576), (130, 1536)])
def test_blocked_codes_round_trip(N, K):
    _, _, codes, _ = case(1, N, K)
    b = block_codes(codes)
    assert b.shape == (-(-N // 64), K, 64) and b.is_contiguous()
    assert torch.equal(unblock_codes(b, N), codes)


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("N,K", [(64, 64), (100, 33), (960, 576), (130, 1536), (4096, 64)])
def test_kernel_matches_reference(M, N, K):
    x, w, codes, scales = case(M, N, K, seed=M * 7 + N)
    got = int8_linear_cpu(x, w.codes_b, w.scales)
    want = x @ (codes.float() * scales[:, None]).t()
    assert got.shape == (M, N)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))
    torch.testing.assert_close(int8_linear_ref(x, w.codes_b, w.scales), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("N,K", [(100, 33), (960, 576), (130, 1536), (64, 200)])
def test_a_row_does_not_depend_on_its_batch(N, K):
    """Past 4 rows the kernel widens each chunk of codes once for every row; each row's result is still the
    one-row kernel's, bit for bit (the same products, added over k in the same order)."""
    x, w, _, _ = case(16, N, K, seed=N + K)
    alone = torch.cat([int8_linear_cpu(x[i:i + 1].contiguous(), w.codes_b, w.scales) for i in range(16)])
    for M in (5, 8, 13, 16):
        assert torch.equal(int8_linear_cpu(x[:M].contiguous(), w.codes_b, w.scales), alone[:M])


@needs_kernels
def test_dispatch_gives_many_rows_to_the_reference(monkeypatch):
    monkeypatch.setenv("TRTKV_KERNELS", "auto")
    import plugins.cpu_kernels.ops as cpu_ops

    calls = []
    real = cpu_ops.int8_linear_cpu
    monkeypatch.setattr(cpu_ops, "int8_linear_cpu", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for M in (1, plugin_ops.GEMV_MAX_ROWS, plugin_ops.GEMV_MAX_ROWS + 1):
        x, w, codes, scales = case(M, 96, 80)
        torch.testing.assert_close(plugin_ops.int8_linear(x, w.codes_b, w.scales),
                                   x @ (codes.float() * scales[:, None]).t(), rtol=1e-5, atol=1e-4)
    assert calls == [1, plugin_ops.GEMV_MAX_ROWS]
