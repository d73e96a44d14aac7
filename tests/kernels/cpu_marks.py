"""Shared marks of the compiled-CPU-kernel tests."""
from __future__ import annotations

import pytest

from plugins.cpu_kernels import cpu_kernels_available

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(),
                                   reason="no C++ CPU kernels here: none built at install fits, none built at first use")
