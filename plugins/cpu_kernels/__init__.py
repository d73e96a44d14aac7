"""Compiled CPU kernels (C++/OpenMP, built at first use): paged attention and kv_write over packed pages.

The torch references in ``plugins/paged_attention`` and ``plugins/kv_write`` stay the oracles these
kernels are tested against (tests/kernels/test_cpu_kernels.py). ``plugins.backend`` picks them on CPU.
"""
from plugins.cpu_kernels.build import cpu_kernels, cpu_kernels_available
from plugins.cpu_kernels.ops import kv_write_cpu, paged_attention_cpu

__all__ = ["cpu_kernels", "cpu_kernels_available", "kv_write_cpu", "paged_attention_cpu"]
