"""ThinKV's offline calibration (spec §2.3, Algorithm 1 of the paper): which layers' attention sparsity
separates the thought types, and the two sparsity thresholds between them.

One module per job::

    collect.py    FullKV generations watched by an observer      -> CalibrationData (u[p][step, layer], K/V amax)
    density.py    KDE per (prompt, layer), its modes and valleys
    analysis.py   layer ranking, thresholds, the quantile fallback -> Analysis
    artifact.py   an Analysis as a CalibrationArtifact (trtkv/artifacts/calibration.py: the record, its one
                  validator and writer)
    run.py        calibrate() / calibrate_for_build(): prompts, temporary full engine, raw data, all of the above

The names below are the public API (``trtkv calibrate``, the builder, the plot and the tests import them).
"""
from trtkv.build.calibration.analysis import (DEFAULT_NUM_LAYERS, DEFAULT_TARGET_SHARES, RULE_FALLBACK, RULE_KDE,
                                              RULES, Analysis, analyze, classify_shares, parse_shares,
                                              pooled_u_bar)
from trtkv.artifacts.calibration import (ARTIFACT_VERSION, REL_THRESHOLD, SPARSITY_DEF_VERSION,
                                         CalibrationArtifact, KVAmax, layer_scales, load_calibration,
                                         packaged_calibration, save_calibration, summary_lines)
from trtkv.build.calibration.artifact import build_artifact, make_artifact
from trtkv.build.calibration.collect import (DEFAULT_MIN_KEYS, CalibrationData, SparsityObserver, collect_sparsity,
                                             model_default_sampling)
from trtkv.build.calibration.density import GRID_POINTS, MODE_FLOOR, find_modes, find_valleys, kde_on_grid
from trtkv.build.calibration.run import (calibrate, calibrate_for_build, load_prompts, load_raw, open_full_engine,
                                         save_raw)

__all__ = ["ARTIFACT_VERSION", "Analysis", "CalibrationArtifact", "CalibrationData", "DEFAULT_MIN_KEYS",
           "DEFAULT_NUM_LAYERS", "DEFAULT_TARGET_SHARES", "GRID_POINTS", "KVAmax", "MODE_FLOOR", "REL_THRESHOLD",
           "RULES", "RULE_FALLBACK", "RULE_KDE", "SPARSITY_DEF_VERSION", "SparsityObserver", "analyze",
           "build_artifact", "calibrate", "calibrate_for_build", "classify_shares", "collect_sparsity",
           "find_modes", "find_valleys", "kde_on_grid", "layer_scales", "load_calibration", "load_prompts",
           "load_raw", "make_artifact", "model_default_sampling", "open_full_engine", "packaged_calibration",
           "parse_shares", "pooled_u_bar", "save_calibration", "save_raw", "summary_lines"]
