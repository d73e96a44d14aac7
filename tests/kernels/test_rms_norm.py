"""RMS normalization: the compiled CPU kernel is bit-identical to the torch reference, and ``plugins.ops.rms_norm``
runs it only for plain fp32 CPU rows in eager mode."""
from __future__ import annotations

import pytest
import torch

import plugins.ops as plugin_ops
from plugins.cpu_kernels.ops import rms_norm_cpu
from plugins.rms_norm.reference import rms_norm_ref
from cpu_marks import needs_kernels


def case(T: int, C: int, seed: int = 0, scale: float = 3.0):
    """Rows as the decoder passes them: the residual stream, or a column slice of a wider product (strided)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, C + 5, generator=gen) * scale
    return wide[:, :C], torch.rand(C, generator=gen) + 0.5


@needs_kernels
@pytest.mark.parametrize("T", [1, 16, 300])  # decode rows; a prefill that fans out over threads
@pytest.mark.parametrize("C", [576, 4096, 33])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_kernel_matches_the_reference(T, C, eps):
    x, w = case(T, C, seed=T + C)
    got = rms_norm_cpu(x, w, eps)
    ref = rms_norm_ref(x, w, eps)
    assert got.is_contiguous() and got.shape == (T, C)
    assert torch.equal(got, ref)
    assert torch.equal(rms_norm_cpu(x.contiguous(), w, eps), got)  # the strided rows read as the contiguous
    assert torch.equal(rms_norm_cpu(x, w * 2, eps), got * 2)  # the weight scales each channel, last


@needs_kernels
def test_tiny_and_non_finite_rows():
    x, w = case(3, 64)
    x = x.clone()
    x[0] = 0.0  # eps keeps a zero row finite: zeros out
    x[1, 3] = float("inf")
    x[2, 7] = float("nan")
    got, ref = rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert torch.equal(got[0], torch.zeros(64)) and torch.equal(ref[0], got[0])
    assert torch.equal(got.isnan(), ref.isnan())


@needs_kernels
def test_dispatch_takes_the_reference_outside_plain_fp32_eager(monkeypatch):
    monkeypatch.setenv("TRTKV_KERNELS", "auto")  # this file also runs under TRTKV_KERNELS=triton
    x, w = case(4, 64)
    calls = []
    import plugins.cpu_kernels.ops as cpu_ops

    monkeypatch.setattr(cpu_ops, "rms_norm_cpu", lambda *a: calls.append(1) or rms_norm_ref(*a))
    plugin_ops.rms_norm(x, w, 1e-5)
    assert calls == [1]
    plugin_ops.rms_norm(x.to(torch.bfloat16), w.to(torch.bfloat16), 1e-5)  # other dtypes
    plugin_ops.rms_norm(x.unsqueeze(0), w, 1e-5)  # not [T, C]
    plugin_ops.rms_norm(x.t().contiguous().t(), w, 1e-5)  # channels not contiguous
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # torch.export / torch.compile trace with fake tensors
        plugin_ops.rms_norm(torch.randn(4, 64), torch.ones(64), 1e-5)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    plugin_ops.rms_norm(x, w, 1e-5)
    assert calls == [1]


def test_reference_mode_skips_the_kernel(monkeypatch):
    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    x, w = case(2, 64)
    import plugins.cpu_kernels.ops as cpu_ops

    monkeypatch.setattr(cpu_ops, "rms_norm_cpu", lambda *a: pytest.fail("the compiled kernel ran in reference mode"))
    assert torch.equal(plugin_ops.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
