"""The calibration package reproduces the numbers of the single-file implementation it replaced.

Golden numbers (tests/data/calibration_*_golden.json) were recorded with trtkv at commit e47b56a (before
issue 13's split): the analysis on fixed synthetic data and on 4 prompts of a SmolLM2-135M collection
(16 prompts x 192 tokens, greedy, fp32 CPU — the same collection that reproduces the shipped
configs/calibration/smollm2-135m.json), and the recorded sparsities of short collections.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trtkv.build.calibration import analyze

DATA = Path(__file__).parent / "data"


def _synth_tri(seed=0, prompts=8, steps=400, tri=(1, 3, 4, 6), layers=8):
    rng = np.random.default_rng(seed)
    u = []
    for _ in range(prompts):
        comp = rng.integers(0, 3, steps)
        cols = [(np.array([0.3, 0.6, 0.9]) if layer in tri else np.array([0.4, 0.8, 0.8]))[comp]
                + rng.normal(0, 0.03, steps) for layer in range(layers)]
        u.append(np.stack(cols, 1))
    return u


def _synth_fallback(seed=4):
    rng = np.random.default_rng(seed)
    return [np.stack([0.85 + 0.02 * p + rng.normal(0, 0.004 * (1 + layer), 500) for layer in range(8)], 1)
            for p in range(6)]


def _synth_big(seed=5):  # > 4096 points per (prompt, layer): the binned KDE path
    rng = np.random.default_rng(seed)
    return [np.stack([np.clip(np.array([0.3, 0.6, 0.9])[rng.integers(0, 3, 5000)] + rng.normal(0, 0.05, 5000), 0, 1)
                      for _ in range(3)], 1) for _ in range(2)]


def _smollm2_sample():
    z = np.load(DATA / "calibration_smollm2_sample.npz")
    return [z[f"u_{i}"] for i in range(len(z.files))]


CASES = {
    "tri": (_synth_tri, dict(num_layers=4)),
    "tri_few": (lambda: _synth_tri(3, prompts=4, tri=(2, 5)), dict(num_layers=4)),
    "fallback": (_synth_fallback, dict(num_layers=3, target_shares={"E": 0.25, "R": 0.6, "T": 0.15})),
    "fallback3": (_synth_fallback, dict(num_layers=3, fallback_types=3)),
    "binned": (_synth_big, dict(num_layers=2)),
    "smollm2_sample4": (_smollm2_sample, dict(num_layers=4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_analysis_matches_the_previous_implementation(case):
    gold = json.loads((DATA / "calibration_analysis_golden.json").read_text())[case]
    make, kw = CASES[case]
    an = analyze(make(), **kw)
    assert (an.rule, an.layers, an.thought_types, an.n_prompts_used) == (
        gold["rule"], gold["layers"], gold["thought_types"], gold["n_prompts_used"])
    assert an.thresholds == pytest.approx(gold["thresholds"], abs=1e-12)
    assert an.warning == gold["warning"] and an.intersection == gold["intersection"]
    assert an.observed_shares == gold["observed_shares"]
    assert an.per_layer == gold["per_layer"]  # modes per prompt, valleys, spreads: the whole table
    assert sum(an.kde["x"]) == pytest.approx(gold["kde_sums"]["x"], rel=1e-9)
    assert [sum(x) for x in an.kde["layers"]] == pytest.approx(gold["kde_sums"]["layers"], rel=1e-9)
    assert sum(an.kde["u_bar"]) == pytest.approx(gold["kde_sums"]["u_bar"], rel=1e-9)


def _collect(model, case):
    from trtkv.build.calibration import collect_sparsity, load_prompts, open_full_engine

    gold = json.loads((DATA / "calibration_collect_golden.json").read_text())[case]
    prompts, ids = load_prompts(len(gold["prompt_ids"]))
    with open_full_engine(str(model), device="cpu") as eng:
        data = collect_sparsity(eng, prompts, prompt_ids=ids, **gold["config"])
        core_before = eng.core
    assert eng.core is core_before and eng.policy.name == "full"  # observed, not patched
    return gold, data


def _same_recording(gold, data):
    assert data.prompt_ids == gold["prompt_ids"] and data.generated_tokens == gold["generated_tokens"]
    assert [x.tolist() for x in data.steps] == gold["steps"]
    for got, want in zip(data.u, gold["u"]):
        np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=1e-12)
    # amax: a few float ulps (the CPU weight layout changed the projections' summation order since recording)
    np.testing.assert_allclose(data.k_amax, gold["k_amax"], rtol=1e-5)
    np.testing.assert_allclose(data.v_amax, gold["v_amax"], rtol=1e-5)


@pytest.mark.model  # recorded with SmolLM2's tokenizer on the tiny model (tiny_smol_ckpt)
def test_observer_collection_records_what_the_recorder_policy_did_tiny(tiny_smol_ckpt):
    """3 prompts x 40 tokens, stride 2, min_keys 16, batches of 2 (the second batch holds one request)."""
    _same_recording(*_collect(tiny_smol_ckpt, "tiny"))


@pytest.mark.model
def test_observer_collection_records_what_the_recorder_policy_did_smollm2():
    """SmolLM2-135M, 3 prompts x 24 greedy tokens, every step, min_keys 64: all 30 layers' sparsities."""
    _same_recording(*_collect("smollm2-135m", "smollm2"))


def _find_modes_before(f, floor=0.05):
    """The hand-written mode finder that scipy.signal.find_peaks replaced (kept here as the oracle)."""
    f = np.asarray(f, dtype=np.float64)
    if len(f) == 0 or not np.isfinite(f).all() or f.max() <= 0:
        return np.zeros(0, dtype=np.int64)
    left = np.concatenate([[-np.inf], f[:-1]])
    right = np.concatenate([f[1:], [-np.inf]])
    return np.flatnonzero((f > left) & (f >= right) & (f >= floor * f.max()))


def test_find_peaks_modes_equal_the_hand_written_ones():
    from trtkv.build.calibration import find_modes, kde_on_grid

    rng = np.random.default_rng(7)
    grid = np.linspace(0, 1, 1001)
    for _ in range(300):
        parts = [rng.normal(rng.uniform(0, 1), rng.uniform(0.005, 0.1), rng.integers(5, 200))
                 for _ in range(rng.integers(1, 5))]
        f, _ = kde_on_grid(np.concatenate(parts), grid)
        assert np.array_equal(find_modes(f), _find_modes_before(f))
    for f in ([1.0, 1.0, 0.5], [0.5, 1.0, 1.0], [1.0, 0.5, 1.0], [0, 1, 1, 1, 0], [0.0] * 5, [3.0], [1, 0.01, 1]):
        assert np.array_equal(find_modes(np.array(f, float)), _find_modes_before(f)), f
    # the one difference: a flat shoulder on a rising flank is not a mode (the old rule counted it)
    assert find_modes(np.array([0, 1, 1, 2, 0.0])).tolist() == [3]
