"""Paged keys read back dequantized (``gather_keys``, a ThinKV anneal's and AMS's key reads): the compiled CPU
kernel returns the torch reference's fp32 keys exactly for every format — flushed and interleaved pools, any slot
order and repeats, every E4M3 key-scale byte (NaN included) — and refuses slot ids outside the pool in one line."""
from __future__ import annotations

import pytest
import torch
from cpu_marks import needs_kernels
from test_cpu_kernels import B, flushed_pool, interleaved_pool

import plugins.ops as plugin_ops
from plugins.formats import FORMATS
from plugins.gather_keys.reference import gather_keys_ref

H, D, PAGES = 2, 64, 12


def pool_of(name: str, kind: str):
    fmt = FORMATS[name]
    if kind == "flushed":
        slot, group, k_group, _ = flushed_pool(fmt, H, D, PAGES, seed=3, offset_every=4)
    else:
        slot, group, k_group, _ = interleaved_pool(fmt, H, D, PAGES, groups=5, seed=3)
    return fmt, slot, group, k_group


def asked_slots(seed: int, n: int = 300) -> torch.Tensor:
    """Slot ids as a selection asks for them: shuffled, with repeats."""
    return torch.randint(0, PAGES * B, (n,), generator=torch.Generator().manual_seed(seed))


def exactly(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_reference_is_the_formats_decoder_over_gathered_fields():
    fmt, slot, group, k_group = pool_of("nvfp4", "flushed")
    flat = asked_slots(0, 40)
    keys = gather_keys_ref(slot, group, k_group, flat, fmt.code, 0.7)
    from plugins.formats.base import LayerScales

    gid = k_group.flatten()[flat].long()
    k, _ = fmt.decode({n: t.flatten(0, 1)[flat] for n, t in zip(("k", "v", "v_scale"), slot)},
                      {"k_scale": group[0][gid]}, LayerScales(k=0.7, v=1.3))
    exactly(keys, k.float())


@needs_kernels
@pytest.mark.parametrize("kind", ["flushed", "interleaved"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_kernel_matches_reference_exactly(name, kind):
    from plugins.cpu_kernels.ops import gather_keys_cpu

    fmt, slot, group, k_group = pool_of(name, kind)
    for seed, scale in ((0, 0.7), (1, 1.0), (2, 3.1)):
        flat = asked_slots(seed)
        exactly(gather_keys_cpu(slot, group, k_group, flat, fmt.code, scale),
                gather_keys_ref(slot, group, k_group, flat, fmt.code, scale))
    empty = torch.zeros(0, dtype=torch.int64)
    assert gather_keys_cpu(slot, group, k_group, empty, fmt.code, 0.7).shape == (0, H, D)
    exactly(plugin_ops.gather_keys(slot, group, k_group, asked_slots(3), fmt.code, 0.7),
            gather_keys_ref(slot, group, k_group, asked_slots(3), fmt.code, 0.7))


@needs_kernels
@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n].group_fields(H, D)
                                  and FORMATS[n].group_fields(H, D)[0].dtype == torch.uint8])
def test_every_e4m3_key_scale_byte_decodes_as_the_reference(name):
    from plugins.cpu_kernels.ops import gather_keys_cpu

    fmt, slot, group, k_group = pool_of(name, "flushed")
    ks = group[0].view(-1)
    ks[:] = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(ks.numel() // 256 + 1)[: ks.numel()]
    flat = torch.arange(PAGES * B)
    want = gather_keys_ref(slot, group, k_group, flat, fmt.code, 0.7)
    assert torch.isnan(want).any()  # the NaN bytes 0x7F / 0xFF reach the keys
    exactly(gather_keys_cpu(slot, group, k_group, flat, fmt.code, 0.7), want)


@needs_kernels
def test_slots_outside_the_pool_are_one_line_errors():
    from plugins.cpu_kernels.ops import gather_keys_cpu

    fmt, slot, group, k_group = pool_of("nvfp4", "flushed")
    for bad in (PAGES * B, -1):
        with pytest.raises(RuntimeError, match="gather_keys: a slot id outside the pool"):
            gather_keys_cpu(slot, group, k_group, torch.tensor([0, bad]), fmt.code, 0.7)

