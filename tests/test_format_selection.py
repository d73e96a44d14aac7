"""ThinKV formats chosen by measurement at build time (``--set precision=auto``, issue 18)."""
from __future__ import annotations

import json

import pytest

from trtkv.build.format_selection import stored_bits
from trtkv.errors import TrtkvError

from policy_matrix import one_thread  # noqa: F401  (fixture)


def test_stored_bits_count_scales():
    assert stored_bits("fp16", 3, 64) == 16.0
    assert stored_bits("nvfp4", 3, 64) == 4.5  # one E4M3 scale per 16 elements
    assert stored_bits("int4", 3, 64) == 6.0  # fp16 scale + zero point per 16 (keys per channel, values per token)
    assert stored_bits("ternary", 3, 64) < stored_bits("int2", 3, 64) < stored_bits("nvfp4", 3, 64)


def _build(tiny_ckpt, out, **settings):
    from trtkv.build.builder import build_engine

    base = {"precision": "auto", "thought_types": "1", "tau": "16", "group": "16", "retention": "8,4"}
    return json.loads((build_engine(str(tiny_ckpt), "thinkv", out, budget=48, quiet=True, seed=0,
                                    settings={**base, **settings}) / "engine.json").read_text())


@pytest.mark.model
def test_selection_is_deterministic_and_recorded(tiny_ckpt, tmp_path):
    a = _build(tiny_ckpt, tmp_path / "a", avg_bits="4.5")
    b = _build(tiny_ckpt, tmp_path / "b", avg_bits="4.5")
    sel = a["format_selection"]
    assert sel == b["format_selection"]  # same seed, same traces, same measurements, same choice
    assert a["policy"]["params"]["precision"] == sel["precision"] != "auto"
    assert sel["avg_bits"] <= sel["avg_bits_budget"] == 4.5 and sel["shares"] == {"R": 1.0}
    assert {t["format"] for t in sel["trials"]} == set(sel["candidates"]) and len(sel["traces"]) == 2
    fits = [t for t in sel["trials"] if t["bits"] <= 4.5]
    best = max(fits, key=lambda t: (t["top1_agreement"], -t["mean_kl"], -t["bits"]))
    assert sel["precision"] == "R{0}E{0}T{0}".format({"nvfp4": "4", "nvfp4o": "4o", "ternary": "2", "ternaryo": "2o",
                                                      "int2": "2a"}[best["format"]])
    from trtkv.api import Engine

    eng = Engine.load(tmp_path / "a")  # the engine runs with the chosen formats
    assert eng.policy.formats() == {best["format"]}
    from trtkv.runtime.sampling import SamplingParams

    assert eng.generate(["Counting begins with"], SamplingParams(max_tokens=20, ignore_eos=True))[0].text


@pytest.mark.model
def test_selection_budget_too_small(tiny_ckpt, tmp_path):
    with pytest.raises(TrtkvError, match="avg_bits=1 is below every candidate"):
        _build(tiny_ckpt, tmp_path / "c", avg_bits="1")
