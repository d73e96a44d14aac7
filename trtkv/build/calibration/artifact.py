"""An analysis (``analysis.py``) and its collected data as a calibration artifact
(``trtkv.artifacts.calibration.CalibrationArtifact``, the record an engine reads)."""
from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

import numpy as np

from trtkv.artifacts.calibration import ARTIFACT_VERSION, REL_THRESHOLD, SPARSITY_DEF_VERSION, CalibrationArtifact
from trtkv.build.calibration.analysis import Analysis
from trtkv.build.calibration.density import GRID_POINTS, MODE_FLOOR

if TYPE_CHECKING:
    from trtkv.build.calibration.collect import CalibrationData


def _sig(a, digits: int) -> list[float]:
    return [float(f"{v:.{digits}g}") for v in np.asarray(a, dtype=np.float64).ravel()]


def build_artifact(analysis: Analysis, data: CalibrationData | None, model: str,
                   extra: dict[str, Any] | None = None) -> CalibrationArtifact:
    """The artifact of an analysis of ``data`` (None: analysed arrays without collection metadata)."""
    return CalibrationArtifact.from_dict(make_artifact(analysis, data, model, extra))


def make_artifact(analysis: Analysis, data: CalibrationData | None, model: str,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The artifact's JSON form (not yet validated; :func:`build_artifact` gives the typed one)."""
    from trtkv.version import __version__

    meta = data.meta if data is not None else {}
    art: dict[str, Any] = {
        "version": ARTIFACT_VERSION, "model": model, "sparsity_def_version": SPARSITY_DEF_VERSION,
        "rel_threshold": REL_THRESHOLD, "layers": list(analysis.layers),
        "thresholds": [float(analysis.thresholds[0]), float(analysis.thresholds[1])], "rule": analysis.rule,
        "thought_types": analysis.thought_types, "warning": analysis.warning,
        "n_prompts": len(data.u) if data is not None else analysis.n_prompts_used,
        "n_prompts_used": analysis.n_prompts_used, "max_tokens": meta.get("max_tokens"),
        "step_stride": meta.get("step_stride"), "min_keys": meta.get("min_keys"), "sampling": meta.get("sampling"),
        "target_shares": analysis.target_shares, "observed_shares": analysis.observed_shares,
        "intersection": analysis.intersection,
        "kde": {"kernel": "gaussian", "bandwidth": "scott", "grid_points": GRID_POINTS, "mode_floor": MODE_FLOOR,
                **analysis.kde},
        "per_layer": analysis.per_layer,
        "kv_amax": ({"k": _sig(data.k_amax, 7), "v": _sig(data.v_amax, 7)} if data is not None else None),
        "stats": ({"recorded_steps": int(sum(len(x) for x in data.u)),
                   "generated_tokens": int(sum(data.generated_tokens)),
                   "collect_s": meta.get("collect_s")} if data is not None else None),
        "trtkv_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    art.update(extra or {})
    return art
