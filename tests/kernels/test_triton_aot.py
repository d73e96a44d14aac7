"""Every Triton kernel specialization the registry's models use compiles for a CUDA target and does not
spill (plugins/triton_aot.py). Needs no GPU: triton.compile runs down to the cubin with Triton's ptxas.

CI compiles for sm_80, sm_90 and sm_100, each with the warps and stages ``launch_config`` picks for that target
(``TRTKV_AOT_TARGETS=90`` narrows it); build_scripts/triton_aot_report.py writes the table into docs/kernels.md.
"""
from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="AOT compiles real cubins; the interpreter pass of make test-kernels skips it")


def _registry_archs():
    from trtkv.models.registry import load_registry

    return [spec.arch for spec in load_registry().values() if spec.config]


def test_specializations_cover_the_registry():
    from plugins.formats import FORMATS
    from plugins.triton_aot import all_specs, model_geometries

    geos = model_geometries(_registry_archs())
    assert (3, 64) in geos and (4, 128) in geos  # SmolLM2-135M, R1-Distill-Llama-8B
    labels = {s.label for s in all_specs(_registry_archs())}
    for name in FORMATS:
        assert f"paged_attention {name} G=4 D=128" in labels and f"kv_write {name} D=64" in labels


def test_every_specialization_compiles_without_spills(tmp_path):
    from plugins.triton_aot import all_specs, compile_all, report_markdown

    targets = tuple(int(t) for t in os.environ.get("TRTKV_AOT_TARGETS", "80,90,100").split(","))
    usages = compile_all(all_specs(_registry_archs()), targets=targets, cache_dir=str(tmp_path / "triton-cache"))  # no reuse
    bad = [u for u in usages if u.error or u.spills]
    assert not bad, "kernels failing to compile or spilling:\n" + report_markdown(bad)
    assert all(0 < u.registers <= 255 for u in usages)
