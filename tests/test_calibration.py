"""ThinKV offline calibration (spec §2.3, §9 item 4): KDE modes and valleys, layer choice, the no-tri-modal
fallback, artifact validation, and a tiny end-to-end collection through the engine."""
from __future__ import annotations

import json

import numpy as np
import pytest

from trtkv.build.calibration import (RULE_FALLBACK, RULE_KDE, SPARSITY_DEF_VERSION, analyze, calibrate,
                                     classify_shares, find_modes, find_valleys, kde_on_grid, layer_scales,
                                     load_calibration, make_artifact, parse_shares, save_calibration)
from trtkv.errors import TrtkvError

GRID = np.linspace(0, 1, 1001)


def _mixture(rng, n, means, sd=0.03):
    """Per-step sparsity of one prompt: a component per step, shared by all layers of that step."""
    comp = rng.integers(0, len(means), n)
    return comp, np.asarray(means)[comp] + rng.normal(0, sd, n)


def _tri_bi_data(rng, prompts=8, steps=400, tri_layers=(1, 3, 4, 6), layers=8):
    u = []
    for _ in range(prompts):
        comp = rng.integers(0, 3, steps)
        cols = []
        for layer in range(layers):
            if layer in tri_layers:
                cols.append(np.array([0.3, 0.6, 0.9])[comp] + rng.normal(0, 0.03, steps))
            else:  # bimodal: two thought types merged
                cols.append(np.array([0.4, 0.8, 0.8])[comp] + rng.normal(0, 0.03, steps))
        u.append(np.stack(cols, 1))
    return u


def test_kde_modes_and_valleys_on_three_gaussians():
    rng = np.random.default_rng(1)
    _, x = _mixture(rng, 900, [0.3, 0.6, 0.9])
    f, bw = kde_on_grid(x, GRID)
    assert bw > 0
    m = find_modes(f)
    assert len(m) == 3
    vi, depth = find_valleys(f, m)
    assert abs(GRID[vi[0]] - 0.45) < 0.02 and abs(GRID[vi[1]] - 0.75) < 0.02
    assert (depth > 0.5).all()


def test_kde_degenerate_inputs_do_not_crash():
    f, bw = kde_on_grid(np.full(40, 0.93), GRID)
    assert bw == 0 and len(find_modes(f)) == 1 and abs(GRID[find_modes(f)[0]] - 0.93) < 2e-3
    f, _ = kde_on_grid(np.array([]), GRID)
    assert not f.any() and len(find_modes(f)) == 0
    f, _ = kde_on_grid(np.array([0.5]), GRID)
    assert len(find_modes(f)) == 1
    # constant sequences in every layer: analysis still returns ordered thresholds and a warning
    an = analyze([np.full((30, 3), 0.9) for _ in range(3)], num_layers=2)
    assert an.rule == RULE_FALLBACK and an.thresholds[0] < an.thresholds[1] and an.warning


def test_binned_kde_matches_scipy():
    from scipy.stats import gaussian_kde

    rng = np.random.default_rng(2)
    _, x = _mixture(rng, 6000, [0.3, 0.6, 0.9])
    f, _ = kde_on_grid(x, GRID)  # > 4096 points: binned evaluation
    ref = gaussian_kde(x)(GRID)
    assert np.abs(f - ref).max() < 1e-4 * ref.max()


def test_three_gaussian_thresholds_and_layer_choice():
    rng = np.random.default_rng(0)
    u = _tri_bi_data(rng)
    an = analyze(u, num_layers=4)
    assert an.rule == RULE_KDE
    assert an.layers == [1, 3, 4, 6]  # the bimodal layers are excluded
    assert len(an.layers) == 4
    lo, hi = an.thresholds
    assert abs(lo - 0.45) <= 0.02 and abs(hi - 0.75) <= 0.02
    assert an.warning == ""
    assert an.intersection == [1, 3, 4, 6]
    per = {d["layer"]: d for d in an.per_layer}
    assert per[0]["three_mode_prompts"] == 0 and per[0]["modes_per_prompt"] == [2] * 8
    assert per[1]["three_mode_prompts"] == 8
    # shares follow the mixture (one third each)
    assert all(abs(an.observed_shares[t] - 1 / 3) < 0.05 for t in "ERT")


def test_fewer_trimodal_layers_than_asked():
    rng = np.random.default_rng(3)
    an = analyze(_tri_bi_data(rng, prompts=4, tri_layers=(2, 5)), num_layers=4)
    assert an.rule == RULE_KDE and an.layers == [2, 5]
    assert "only 2 layer(s)" in an.warning


def test_fallback_when_no_layer_is_trimodal():
    rng = np.random.default_rng(4)
    # unimodal layers with different within-prompt spread (and a per-prompt offset that must not matter)
    u = []
    for p in range(6):
        off = 0.02 * p
        u.append(np.stack([0.85 + off + rng.normal(0, 0.004 * (1 + layer), 500) for layer in range(8)], 1))
    target = {"E": 0.25, "R": 0.6, "T": 0.15}
    an = analyze(u, num_layers=3, target_shares=target)
    assert an.rule == RULE_FALLBACK
    assert an.layers == [5, 6, 7]  # largest within-prompt sd
    assert an.thresholds[0] < an.thresholds[1]
    for t in "ERT":
        assert abs(an.observed_shares[t] - target[t]) < 0.02
    assert "NO LAYER IS TRI-MODAL" in an.warning
    assert an.target_shares == target
    art = make_artifact(an, None, "synthetic")
    assert art["rule"] == RULE_FALLBACK and art["warning"] and art["target_shares"] == target
    # the paper's §E.10 setting by default: one thought type; the bands on request
    assert an.thought_types == 1 and load_calibration(art)["thought_types"] == 1 and "ONE thought type" in an.warning
    banded = analyze(u, num_layers=3, target_shares=target, fallback_types=3)
    assert banded.thought_types == 3 and banded.thresholds == an.thresholds and "sparsity bands" in banded.warning
    with pytest.raises(TrtkvError):
        analyze(u, num_layers=3, fallback_types=2)


def test_trimodal_data_uses_three_types():
    rng = np.random.default_rng(1)
    u = [np.stack([np.concatenate([rng.normal(m, 0.03, 200) for m in (0.3, 0.6, 0.9)]) for _ in range(4)], 1)
         for _ in range(5)]
    an = analyze(u, num_layers=2, fallback_types=1)
    assert an.rule == RULE_KDE and an.thought_types == 3
    art = make_artifact(an, None, "synthetic")
    legacy = {k: v for k, v in art.items() if k != "thought_types"}  # artifacts written before the field
    assert load_calibration(legacy)["thought_types"] == 3
    with pytest.raises(TrtkvError, match="thought_types"):
        load_calibration({**art, "thought_types": 2})


def test_classify_shares_boundaries():
    s = classify_shares(np.array([0.1, 0.2, 0.5, 0.7, 0.9]), (0.2, 0.7))
    assert s == {"E": 0.2, "R": 0.4, "T": 0.4}  # θ_low -> R, θ_high -> T


def test_parse_shares():
    assert parse_shares("E=0.1,R=0.7,T=0.2") == {"E": 0.1, "R": 0.7, "T": 0.2}
    for bad in ("E=0.5,R=0.6,T=0.2", "E=0.2,R=0.8", "E=x,R=0.5,T=0.5", "E=0,R=0.8,T=0.2"):
        with pytest.raises(TrtkvError):
            parse_shares(bad)


def _valid():
    return {"version": 1, "model": "m", "sparsity_def_version": SPARSITY_DEF_VERSION, "rel_threshold": 0.01,
            "layers": [1, 2], "thresholds": [0.4, 0.8], "rule": RULE_KDE, "warning": "",
            "kv_amax": {"k": [1.0, 2.0, 3.0], "v": [0.5, 0.5, 0.5]}}


@pytest.mark.parametrize("patch", [
    {"version": 7}, {"sparsity_def_version": "other"}, {"layers": []}, {"layers": [1, 1]}, {"layers": ["a"]},
    {"thresholds": [0.8, 0.4]}, {"thresholds": [0.5, 0.5]}, {"thresholds": [0.4]}, {"thresholds": [0.4, 1.5]},
    {"thresholds": "0.4,0.8"}, {"rule": "magic"}, {"kv_amax": {"k": [1.0], "v": [1.0, 2.0]}},
    {"kv_amax": {"k": [-1.0, 1, 1], "v": [1.0, 1, 1]}}, {"rel_threshold": 0.05}, {"warning": 3},
])
def test_malformed_calibration_is_a_clear_error(patch):
    load_calibration(_valid())
    with pytest.raises(TrtkvError, match="invalid calibration"):
        load_calibration({**_valid(), **patch})


def test_malformed_calibration_files(tmp_path):
    with pytest.raises(TrtkvError, match="not found"):
        load_calibration(tmp_path / "none.json")
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(TrtkvError, match="not JSON"):
        load_calibration(p)
    p.write_text("[1, 2]")
    with pytest.raises(TrtkvError, match="JSON object"):
        load_calibration(p)
    with pytest.raises(TrtkvError, match="does not exist"):
        load_calibration(_valid(), num_layers=2)
    with pytest.raises(TrtkvError, match="kv_amax"):
        load_calibration({**_valid(), "layers": [0]}, num_layers=2)


def test_layer_scales_from_amax():
    sc = layer_scales(_valid(), "nvfp4", 3)
    assert len(sc) == 3 and abs(sc[0].k - 1.0 / (6 * 448)) < 1e-6 and abs(sc[2].k - 3.0 / (6 * 448)) < 1e-6
    assert all(s.k == 1.0 for s in layer_scales(None, "nvfp4", 3))


def test_end_to_end_tiny_model(tiny_ckpt, tmp_path):
    png = tmp_path / "calib.png"
    logs = []
    raw = tmp_path / "raw.npz"
    art = calibrate(str(tiny_ckpt), n_prompts=2, max_tokens=24, stride=1, num_layers=2, min_keys=16,
                    batch_size=2, plot=png, log=logs.append, device="cpu", raw_out=raw)
    art = load_calibration(art, num_layers=2)
    assert art["rule"] in (RULE_KDE, RULE_FALLBACK)
    assert art["n_prompts"] == 2 and art["max_tokens"] == 24 and art["step_stride"] == 1 and art["min_keys"] == 16
    assert len(art["layers"]) == 2 and len(art["per_layer"]) == 2
    assert all(len(d["modes_per_prompt"]) == art["n_prompts_used"] for d in art["per_layer"])
    assert len(art["kv_amax"]["k"]) == 2 and all(a > 0 for a in art["kv_amax"]["k"] + art["kv_amax"]["v"])
    assert abs(sum(art["observed_shares"].values()) - 1) < 1e-6
    assert art["stats"]["recorded_steps"] > 0
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("prompts" in line for line in logs)
    out = save_calibration(art, tmp_path / "c.json")
    assert load_calibration(out)["thresholds"] == art["thresholds"]
    json.loads(out.read_text())
    again = calibrate("ignored", num_layers=2, raw_in=raw)  # re-analysis without generating
    assert again["thresholds"] == art["thresholds"] and again["kv_amax"] == art["kv_amax"]
    assert again["model"] == art["model"] and again["max_tokens"] == 24


def test_cli_bad_input_is_one_line_error(tmp_path):
    import subprocess
    import sys

    from cli_helpers import assert_one_line_error

    for args, needle in ((["--prompts", "0"], "--prompts must be positive"),
                         (["--target-shares", "E=0.5,R=0.6,T=0.2"], "sum to 1"),
                         (["--from-raw", str(tmp_path / "none.npz")], "cannot read raw")):
        p = subprocess.run([sys.executable, "-m", "trtkv.cli", "calibrate", "smollm2-135m", *args,
                            "--out", str(tmp_path / "c.json")], capture_output=True, text=True, timeout=120)
        assert_one_line_error(p, needle)
