"""Engines decoding through the Triton kernels (on CUDA, or the interpreter on CPU) give the tokens the CPU
path gives: ThinKV's two page formats in one attention launch a layer, H2O's statistics from that launch's
logits, the fused split merge."""
from __future__ import annotations

import os

import pytest
import torch

from trtkv.runtime.request import SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before Python starts)",
)

# ThinKV's schedule puts T segments in ternary pages beside the R/E segments' NVFP4 ones: two formats a layer
ENGINES = {"thinkv": dict(budget=24, tau=4, group=4, retention="2", thought_schedule="RTETRRTE"),
           "h2o": dict(budget=16), "full": {}}


@pytest.mark.parametrize("precision", ["tf32x3", "f16"])
@pytest.mark.parametrize("policy", list(ENGINES))
def test_triton_decode_gives_the_reference_tokens(policy, precision, engine_factory, load_engine, tiny_ckpt,
                                                  monkeypatch):
    eng = load_engine(engine_factory(tiny_ckpt, policy, **ENGINES[policy]))
    params = SamplingParams(max_tokens=40, ignore_eos=True, chat=False)
    monkeypatch.setenv("TRTKV_KERNELS", "reference")
    want = eng.generate("Numbers: 1, 2, 3", params)[0]
    monkeypatch.setenv("TRTKV_KERNELS", "triton")
    monkeypatch.setenv("TRTKV_TRITON_PRECISION", precision)
    got = eng.generate("Numbers: 1, 2, 3", params)[0]
    assert got.token_ids == want.token_ids
    if policy != "full":
        assert got.stats["evicted_tokens"] == want.stats["evicted_tokens"] > 0
