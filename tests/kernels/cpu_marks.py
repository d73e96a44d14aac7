"""Shared marks of the compiled-CPU-kernel tests."""
from __future__ import annotations

import pytest

from plugins.cpu_kernels import cpu_kernels_available

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here")
