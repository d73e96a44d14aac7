"""Which implementation a plugin runs: the Triton kernel on CUDA, the torch reference elsewhere.

``TRTKV_KERNELS=triton`` forces the Triton path (with ``TRITON_INTERPRET=1`` on CPU, for tests);
``TRTKV_KERNELS=reference`` forces the reference everywhere.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("TRTKV_KERNELS", "auto")
    if mode == "reference":
        return False
    if mode == "triton":
        return triton_available()
    return t.is_cuda and triton_available()
