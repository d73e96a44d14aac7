"""Compiled CPU kernels (C++/OpenMP, built at install; see build.py): paged attention and kv_write over packed pages,
attention over the residual buffers, and k-means token selection.

The torch references in ``plugins/paged_attention``, ``plugins/kv_write``, ``plugins/buffer_attention`` and
``plugins/kmeans_select`` stay the oracles these kernels are tested against (tests/kernels).
``plugins.backend`` picks them on CPU.
"""
from plugins.cpu_kernels.build import cpu_kernels, cpu_kernels_available
from plugins.cpu_kernels.ops import (buffer_attention_cpu, kmeans_select_cpu, kv_write_cpu, kv_write_groups_cpu,
                                     paged_attention_cpu)

__all__ = ["buffer_attention_cpu", "cpu_kernels", "cpu_kernels_available", "kmeans_select_cpu", "kv_write_cpu",
           "kv_write_groups_cpu", "paged_attention_cpu"]
