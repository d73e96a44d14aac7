"""Host memory for the KV pools: large CPU tensors on transparent huge pages.

A decode step writes one token of every request into every layer's pool, each to a different page of the
pool, and attention then reads every live page: at 32 layers x 256 requests that is tens of thousands of
4 KiB pages a step, far more than the TLB holds, so nearly every scattered store also walks the page tables
(two-dimensional walks in a VM). On 2 MiB pages the same pools span a few hundred TLB entries: the write
kernel's time fell ~30% at that shape (docs/benchmarks.md, "Engine overhead").

Linux backs anonymous memory with huge pages only where ``madvise(MADV_HUGEPAGE)`` asks when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common default), and only 2 MiB-aligned
ranges; torch's CPU allocator does neither. So a CPU tensor of at least ``HUGE_PAGE`` bytes comes from its own
anonymous mapping, aligned and advised; smaller ones, other devices, and systems without ``MADV_HUGEPAGE`` use
``torch.empty``. The mapping is zero-filled and committed page by page as it is first touched, like
``torch.empty``'s large allocations, and unmapped when the last tensor viewing it goes.
"""
from __future__ import annotations

import math
import mmap
import os

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64 and arm64's transparent huge page)
ENV = "TRTKV_HUGE_PAGES"  # "0": plain torch.empty (e.g. to compare)


def huge_pages_enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV, "1") != "0"


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu", huge: bool = True
               ) -> torch.Tensor:
    """An uninitialised tensor like ``torch.empty(shape, dtype=dtype, device=device)``; on CPU, from
    ``HUGE_PAGE`` bytes up and unless ``huge`` is False, on transparent huge pages (see the module docstring)."""
    device = torch.device(device)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if not huge or device.type != "cpu" or nbytes < HUGE_PAGE or not huge_pages_enabled():
        return torch.empty(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: the mapping still works, on small pages
        pass
    start = np.frombuffer(buf, np.uint8, 1).ctypes.data
    # the tensor keeps the mapping alive (torch.frombuffer holds a reference to it)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=(-start) % HUGE_PAGE).view(shape)
