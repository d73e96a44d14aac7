"""Which implementation a plugin runs: Triton on CUDA, the compiled C++ kernels on CPU, the torch reference
as the fallback and the oracle.

``TRTKV_KERNELS`` overrides the choice: ``reference`` forces the torch reference everywhere; ``triton``
forces the Triton path (with ``TRITON_INTERPRET=1`` on CPU, for tests); ``cpu`` forces the compiled CPU
kernels for CPU tensors (the default there whenever they built; if they cannot be built a single log
line says so and the reference runs instead).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

MODES = ("auto", "reference", "triton", "cpu")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


_pinned: str | None = None  # TRTKV_KERNELS as read at the start of the enclosing ``pinned_mode`` block


@contextlib.contextmanager
def pinned_mode():
    """Read ``TRTKV_KERNELS`` once for a block of plugin calls (a decode step makes a few hundred; each read of
    the environment costs microseconds). A change to the variable inside the block applies from the next one."""
    global _pinned
    outer = _pinned
    _pinned = outer or _mode()
    try:
        yield
    finally:
        _pinned = outer


def _mode() -> str:
    if _pinned is not None:
        return _pinned
    mode = os.environ.get("TRTKV_KERNELS", "auto")
    if mode not in MODES:
        from trtkv.errors import TrtkvError

        raise TrtkvError(f"TRTKV_KERNELS={mode!r} is not one of {', '.join(MODES)}; unset it or pick one")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    return kernel_impl(t) == "triton"


def use_cpu_kernels(t: torch.Tensor) -> bool:
    """The compiled CPU kernels: on CPU tensors unless the reference or Triton is forced, and if they built."""
    return kernel_impl(t) == "cpu"


@functools.cache
def _cpu_build():
    from plugins.cpu_kernels import build

    return build


def kernel_impl(t: torch.Tensor) -> str:
    """``triton``, ``cpu`` or ``reference``: what a plugin call on ``t`` runs. Asked before every plugin call (a
    few hundred a decode step): the environment read once, ``is_cpu`` / ``is_cuda`` and a module looked up once,
    not a ``torch.device`` and an import statement per call."""
    mode = _mode()
    if (mode == "triton" or (mode == "auto" and t.is_cuda)) and triton_available():
        return "triton"
    if t.is_cpu and mode in ("auto", "cpu") and _cpu_build().cpu_kernels_available():
        return "cpu"
    return "reference"
