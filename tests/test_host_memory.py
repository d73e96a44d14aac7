"""Large CPU pool tensors on transparent huge pages (trtkv/cache/host_memory.py)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from trtkv.cache.host_memory import HUGE_PAGE, host_empty, huge_pages_enabled
from trtkv.cache.pool import PagePool
from plugins.formats import get_format


def test_small_tensors_are_plain_torch_empty():
    t = host_empty((3, 4), torch.float16)
    assert t.shape == (3, 4) and t.dtype == torch.float16 and t.is_contiguous()


@pytest.mark.skipif(not huge_pages_enabled(), reason="no MADV_HUGEPAGE on this system")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float16, torch.float32])
def test_large_tensors_start_on_a_huge_page_and_hold_what_is_written(dtype):
    shape = (HUGE_PAGE // dtype.itemsize // 64 + 7, 8, 8)
    t = host_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()  # a fresh anonymous mapping reads zeros
    src = torch.arange(t.numel()).remainder(100).to(dtype).view(shape)
    t.copy_(src)
    view = t[5:9]
    del t
    gc.collect()  # the view keeps the mapping alive
    assert torch.equal(view, src[5:9])


def test_the_switch_turns_huge_pages_off(monkeypatch):
    monkeypatch.setenv("TRTKV_HUGE_PAGES", "0")
    assert not huge_pages_enabled()
    t = host_empty((HUGE_PAGE,), torch.uint8)
    assert t.numel() == HUGE_PAGE


def test_a_large_pool_writes_and_reads_its_pages_on_huge_pages():
    pool = PagePool(get_format("fp16"), 2, 64, 16, "cpu", pages=1024)
    assert pool.fields[0].nbytes >= HUGE_PAGE
    if huge_pages_enabled():
        assert all(f.data_ptr() % HUGE_PAGE == 0 for f in pool.fields)
    pages = pool.alloc_pages(3, 0)
    x = torch.randn(2, 64).half()
    pool.fields[0][pages[-1], 5] = x
    assert torch.equal(pool.fields[0][pages[-1], 5], x)
    assert np.all(pages >= 0)
