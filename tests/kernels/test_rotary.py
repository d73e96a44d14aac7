"""Rotary embedding: the compiled CPU kernel is bit-identical to the torch reference, and ``plugins.ops.rotary``
runs it only for plain fp32 CPU tensors in eager mode (torch.compile and export trace the reference)."""
from __future__ import annotations

import pytest
import torch

import plugins.ops as plugin_ops
from plugins.cpu_kernels.ops import rotary_cpu
from plugins.rotary.reference import rotary_ref
from cpu_marks import needs_kernels


def case(T: int, D: int, heads: int = 12, extra: int = 3, seed: int = 0):
    """RoPE runs on a column slice of the fused q/k/v product: rows strided, heads contiguous."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (heads + extra) * D, generator=gen) * 10
    x = qkv[:, :heads * D].view(T, heads, D)
    return x, torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)


@needs_kernels
@pytest.mark.parametrize("T", [1, 16, 700])  # decode rows; a prefill that fans out over threads
@pytest.mark.parametrize("D", [64, 128, 10])
def test_kernel_is_bit_identical(T, D):
    x, cos, sin = case(T, D, seed=T + D)
    got = rotary_cpu(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, rotary_ref(x, cos, sin))
    # non-finite inputs propagate the same way
    x = x.clone()
    x[0, 0, 0], x[0, 1, D // 2] = float("inf"), float("nan")
    assert torch.equal(rotary_cpu(x, cos, sin).isnan(), rotary_ref(x, cos, sin).isnan())


@needs_kernels
def test_dispatch_takes_the_reference_outside_plain_fp32_eager(monkeypatch):
    monkeypatch.setenv("TRTKV_KERNELS", "auto")  # this file also runs under TRTKV_KERNELS=triton
    x, cos, sin = case(4, 64)
    calls = []
    import plugins.cpu_kernels.ops as cpu_ops

    monkeypatch.setattr(cpu_ops, "rotary_cpu", lambda *a: calls.append(1) or rotary_ref(*a))
    plugin_ops.rotary(x, cos, sin)
    assert calls == [1]
    plugin_ops.rotary(x.to(torch.bfloat16), cos.to(torch.bfloat16), sin.to(torch.bfloat16))  # other dtypes
    plugin_ops.rotary(x, cos[:1], sin[:1])  # broadcast cos/sin
    plugin_ops.rotary(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin)  # heads not contiguous
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # torch.export / torch.compile trace with fake tensors
        plugin_ops.rotary(torch.randn(4, 12, 64), torch.randn(4, 64), torch.randn(4, 64))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    plugin_ops.rotary(x, cos, sin)
    assert calls == [1]


def test_reference_mode_skips_the_kernel(monkeypatch):
    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    x, cos, sin = case(2, 64)
    import plugins.cpu_kernels.ops as cpu_ops

    monkeypatch.setattr(cpu_ops, "rotary_cpu", lambda *a: pytest.fail("the compiled kernel ran in reference mode"))
    assert torch.equal(plugin_ops.rotary(x, cos, sin), rotary_ref(x, cos, sin))
