"""int4 weight-only linear: packing round-trips, and the compiled CPU kernel equals the torch reference to
rounding for every row count it takes (tails of rows and of 64-channel blocks, several group sizes)."""
from __future__ import annotations

import pytest
import torch

import plugins.ops as plugin_ops
from cpu_marks import needs_kernels
from plugins.cpu_kernels.ops import int4_linear_cpu
from plugins.int4_linear.reference import Int4Weight, int4_linear_ref


def case(M: int, N: int, K: int, G: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=gen) + 0.01).half()  # (fp16, as the kernel reads them)
    mins = (-torch.rand(N, K // G, generator=gen) * 8).half()
    dense = (codes.float().view(N, K // G, G) * scales.float()[..., None] + mins.float()[..., None]).view(N, K)
    return torch.randn(M, K, generator=gen) * 3, Int4Weight.pack(codes, scales, mins), codes, (scales, mins), dense


@pytest.mark.parametrize("N,K,G", [(64, 64, 32), (100, 34, 2), (960, 576, 32), (130, 1536, 128)])
def test_packing_round_trips(N, K, G):
    _, w, codes, (scales, mins), _ = case(1, N, K, G)
    assert w.codes_b.shape == (-(-N // 64), K // 2, 64) and w.scales_b.shape == w.mins_b.shape == (-(-N // 64), K // G, 64)
    got_codes, got_scales, got_mins = w.unpack()
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales) and torch.equal(got_mins, mins)


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("N,K,G", [(64, 64, 32), (100, 34, 2), (960, 576, 32), (130, 1536, 128), (4096, 64, 64)])
def test_kernel_matches_reference(M, N, K, G):
    x, w, _, _, dense = case(M, N, K, G, seed=M * 7 + N)
    want = x @ dense.t()
    got = int4_linear_cpu(x, w)
    assert got.shape == (M, N)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))
    torch.testing.assert_close(int4_linear_ref(x, w), want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


@needs_kernels
@pytest.mark.parametrize("N,K,G", [(100, 34, 2), (960, 576, 32), (130, 1536, 128), (64, 200, 8)])
def test_a_row_does_not_depend_on_its_batch(N, K, G):
    """Past 4 rows the kernel widens each chunk of codes once for every row; each row's result is still the
    one-row kernel's, bit for bit (the same products, added over k in the same order)."""
    x, w, _, _, _ = case(16, N, K, G, seed=N + K)
    alone = torch.cat([int4_linear_cpu(x[i:i + 1].contiguous(), w) for i in range(16)])
    for M in (5, 8, 13, 16):
        assert torch.equal(int4_linear_cpu(x[:M].contiguous(), w), alone[:M])


@needs_kernels
def test_dispatch_gives_many_rows_to_the_reference(monkeypatch):
    monkeypatch.setenv("TRTKV_KERNELS", "auto")
    import plugins.cpu_kernels.ops as cpu_ops

    calls = []
    real = cpu_ops.int4_linear_cpu
    monkeypatch.setattr(cpu_ops, "int4_linear_cpu", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for M in (1, plugin_ops.GEMV_MAX_ROWS, plugin_ops.GEMV_MAX_ROWS + 1):
        x, w, _, _, dense = case(M, 96, 80, 16)
        torch.testing.assert_close(plugin_ops.int4_linear(x, w), x @ dense.t(), rtol=1e-5, atol=1e-4)
    assert calls == [1, plugin_ops.GEMV_MAX_ROWS]
