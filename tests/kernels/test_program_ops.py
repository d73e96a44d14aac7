"""``torch.ops.trtkv_cpu``: the compiled CPU kernels registered in C++ (plugins/cpu_kernels/csrc/registrations.cpp),
what a compiled program (``--runtime graph``) calls on CPU. Each gives what the eager entry point gives on the same
inputs, bit for bit, and runs without entering Python; shapes trace through their fake kernels."""
from __future__ import annotations

import pytest
import torch
from test_int4_linear import case as int4_case
from test_kv_write_triton import pools, scatter, tensors
from test_paged_attention_triton import make_pool, make_table
from torch._subclasses.fake_tensor import FakeTensorMode

import plugins.cpu_kernels.ops as cpu_ops
import plugins.ops as plugin_ops
from cpu_marks import needs_kernels
from plugins.formats import FORMATS
from plugins.int8_linear.reference import Int8Weight

pytestmark = needs_kernels


@pytest.fixture(autouse=True)
def _loaded(monkeypatch):
    monkeypatch.setenv("TRTKV_KERNELS", "auto")
    assert plugin_ops.load_program_ops(torch.zeros(1))


@pytest.fixture
def python_calls(monkeypatch):
    """The compiled kernels' Python bindings called so far: a registered op that reached one fell back to its
    Python entry point (its C++ kernel did not register)."""
    calls = []
    for name in ("paged_attention_cpu", "kv_write_cpu", "residual_append_cpu", "buffer_attention_cpu",
                 "int8_linear_cpu", "int4_linear_cpu"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    return calls


def _on_cpu(pool):
    slot, group, k_group, bits = pool
    return [t.cpu() for t in slot], [t.cpu() for t in group], k_group.cpu(), bits.cpu()


@pytest.mark.parametrize("name", ["fp16", "nvfp4o", "int4"])
@pytest.mark.parametrize("b,P", [(1, 3), (1, 40), (3, 20)])  # one sequence over many pages: split in both
def test_paged_attention(name, b, P, python_calls):
    fmt, H, G, D = FORMATS[name], 2, 3, 64
    slot, group, k_group, bits = _on_cpu(make_pool(fmt, H, D, num_pages=b * P + 2, seed=P))
    bt = make_table(b, P, b * P + 2, seed=P).cpu()
    q = torch.randn(b, H * G, D, generator=torch.Generator().manual_seed(b))
    args = (q, slot, group, k_group, bits, bt, fmt.code, D ** -0.5, 0.7, 1.3, True)
    got = torch.ops.trtkv_cpu.paged_attention(*args)
    assert python_calls == []
    want = plugin_ops.paged_attention(*args)
    for a, e in zip(got, want):
        assert torch.equal(a, e)


@pytest.mark.parametrize("name", ["fp16", "nvfp4o", "int4"])
def test_kv_write(name, python_calls):
    fmt, H, D, n = FORMATS[name], 2, 32, 5
    k, v = tensors(name, n, H, D, seed=n)
    pages, slots = scatter(n, seed=n)
    slot, group, kg = pools(fmt, H, D, 0)
    want = ([t.clone() for t in slot], [t.clone() for t in group], kg.clone())
    torch.ops.trtkv_cpu.kv_write(k, v, slot, group, kg, pages, slots, 1, fmt.code, 0.37, 1.7)
    assert python_calls == []
    plugin_ops.kv_write(k, v, *want, pages, slots, 1, fmt.code, 0.37, 1.7)
    for a, e in zip([*slot, *group, kg], [*want[0], *want[1], want[2]]):
        assert torch.equal(a, e)


def test_residual_append_and_buffer_attention(python_calls):
    gen = torch.Generator().manual_seed(0)
    rows, L, g, H, G, D, b = 4, 3, 16, 2, 3, 64, 3
    ak, av = (torch.randn(rows, L, g, H, D, generator=gen).half() for _ in range(2))
    k, v = (torch.randn(b, H, D, generator=gen) for _ in range(2))
    at = torch.tensor([5, 17, 40])
    ak2, av2 = ak.clone(), av.clone()
    torch.ops.trtkv_cpu.residual_append(ak, av, at, k, v)
    q = torch.randn(b, H * G, D, generator=gen)
    out, lse = torch.randn(b, H * G, D, generator=gen), torch.randn(b, H * G, generator=gen)
    out2, lse2 = out.clone(), lse.clone()
    row_ids, counts = torch.tensor([0, 2, 3]), torch.tensor([1, 16, 7])
    torch.ops.trtkv_cpu.buffer_attention(q, ak, av, row_ids, 1, counts, 0.125, out, lse)
    assert python_calls == []
    plugin_ops.residual_append(ak2, av2, at, k, v)
    plugin_ops.buffer_attention(q, ak2, av2, row_ids, 1, counts, 0.125, out2, lse2)
    assert torch.equal(ak, ak2) and torch.equal(av, av2) and torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("M", [1, 3, 16, 24])  # past 16 rows too (the eager entry point hands those to a GEMM)
def test_quantized_linear_takes_any_rows(M, python_calls):
    x, w, _, _, dense = int4_case(M, 130, 576, 32, seed=M)
    got = torch.ops.trtkv_cpu.int4_linear(x, *w)
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-4 * float(got.abs().max()))
    codes = torch.randint(-127, 128, (130, 576), generator=torch.Generator().manual_seed(M), dtype=torch.int8)
    w8 = Int8Weight.pack(codes, torch.rand(130) + 0.01)
    got8 = torch.ops.trtkv_cpu.int8_linear(x, *w8)
    want8 = x @ (codes.float() * w8.scales[:, None]).t()
    torch.testing.assert_close(got8, want8, rtol=1e-5, atol=1e-4 * float(want8.abs().max()))
    assert python_calls == []
    if M <= plugin_ops.GEMV_MAX_ROWS:  # the eager path's kernel, bit for bit
        assert torch.equal(got, plugin_ops.int4_linear(x, w)) and torch.equal(got8, plugin_ops.int8_linear(x, *w8))


def test_fake_kernels_give_the_shapes():
    x, w, _, _, _ = int4_case(3, 130, 576, 32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x)
        assert torch.ops.trtkv_cpu.int4_linear(fx, *w).shape == (3, 130)
