"""The calibration artifact: one typed record (:class:`CalibrationArtifact`), its single validator and writer
(``trtkv.build.calibration`` measures and analyses; ``build_artifact`` there turns an analysis into one).

Why one loader: the artifact travels (``trtkv calibrate --out``, ``configs/calibration/<alias>.json``,
embedded in ``engine.json``) and a ThinKV engine labels thoughts with whatever layers and thresholds it
holds, so every path in reads it through :meth:`CalibrationArtifact.from_dict`, which rejects each
malformed field with one line naming it. The JSON form is unchanged from artifact version 1.

The artifact also carries ``kv_amax`` (per-layer max |K| and |V|), from which quantized formats derive
their static second-level scales (spec §3.2, :func:`layer_scales`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trtkv.errors import TrtkvError

RULE_KDE = "kde-valleys"
RULE_FALLBACK = "fallback-quantiles"
RULES = (RULE_KDE, RULE_FALLBACK)
THOUGHT_TYPE_COUNTS = (1, 3)  # 1: the paper's §E.10 single category (no labels); 3: R / E / T
N_THOUGHT_TYPES = 3
TYPES = ("E", "R", "T")  # ascending sparsity
ARTIFACT_VERSION = 1
SPARSITY_DEF_VERSION = "thinkv-avgrow-v1"  # spec §8 A4: thresholds only apply to the statistic they came from
REL_THRESHOLD = 0.01  # "sparse" = weight below 1% of the row max (runtime/attention.py::row_stats)
_CORE = ("version", "model", "sparsity_def_version", "rel_threshold", "layers", "thresholds", "rule",
         "thought_types", "warning", "kv_amax")


def _bad(where: str, msg: str) -> TrtkvError:
    return TrtkvError(f"invalid calibration {where}: {msg}; rerun `trtkv calibrate`")


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class KVAmax:
    """Per-layer max |K| and |V| (post-RoPE) over calibration text: the static scales of quantized formats."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    n_prompts: int | None = None  # set when measured at build time (prefill only, build/kv_scales.py)
    source: str | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str, num_layers: int | None = None) -> KVAmax:
        if not isinstance(d, dict) or not {"k", "v"} <= set(d) or not set(d) <= {"k", "v", "n_prompts", "source"}:
            raise _bad(where, "'kv_amax' must be {\"k\": [...], \"v\": [...]}")
        for key in ("k", "v"):
            vals = d[key]
            if (not isinstance(vals, list) or not vals
                    or any(not _is_num(x) or not math.isfinite(x) or x < 0 for x in vals)):
                raise _bad(where, f"'kv_amax.{key}' must be a list of finite non-negative numbers")
        if len(d["k"]) != len(d["v"]):
            raise _bad(where, "'kv_amax' k and v have different lengths")
        if num_layers is not None and len(d["k"]) != num_layers:
            raise _bad(where, f"'kv_amax' has {len(d['k'])} layers, the model has {num_layers}")
        n = d.get("n_prompts")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise _bad(where, f"'kv_amax.n_prompts' must be a positive integer, got {n!r}")
        if not isinstance(d.get("source", ""), (str, type(None))):
            raise _bad(where, "'kv_amax.source' must be a string")
        return cls(tuple(float(x) for x in d["k"]), tuple(float(x) for x in d["v"]), n, d.get("source"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": list(self.k), "v": list(self.v)}
        if self.n_prompts is not None:
            out["n_prompts"] = self.n_prompts
        if self.source is not None:
            out["source"] = self.source
        return out


@dataclass(frozen=True)
class CalibrationArtifact:
    """What ThinKV needs (layers L*, thresholds, thought types) plus how it was obtained.

    ``details`` holds the evidence in the artifact's JSON order (prompt counts, shares, max_tokens, sampling,
    KDE densities, per-layer table, timings, ...): reported by :func:`summary_lines` and the plot, never used
    to configure an engine, so it is kept as JSON (the counts and shares are validated all the same)."""

    model: str | None
    layers: tuple[int, ...]
    thresholds: tuple[float, float]
    rule: str
    thought_types: int = N_THOUGHT_TYPES
    warning: str = ""
    kv_amax: KVAmax | None = None
    details: dict[str, Any] = field(default_factory=dict)
    version: int = ARTIFACT_VERSION
    sparsity_def_version: str = SPARSITY_DEF_VERSION
    rel_threshold: float = REL_THRESHOLD

    # --- the one validator ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, c: Any, num_layers: int | None = None, where: str = "data") -> CalibrationArtifact:
        """Validate the JSON form: version, sparsity definition, layers (distinct, in range when
        ``num_layers`` is given), thresholds (finite, in [0, 1], increasing), thought types, rule,
        shares and ``kv_amax``. Artifacts written before ``thought_types`` existed mean 3."""
        if not isinstance(c, dict):
            raise _bad(where, "expected a JSON object")
        if c.get("version") != ARTIFACT_VERSION:
            raise _bad(where, f"version {c.get('version')!r} is not supported (expects {ARTIFACT_VERSION})")
        if c.get("sparsity_def_version") != SPARSITY_DEF_VERSION:
            raise _bad(where, f"sparsity definition {c.get('sparsity_def_version')!r} differs from this trtkv's "
                              f"{SPARSITY_DEF_VERSION!r}")
        if not isinstance(c.get("model"), (str, type(None))):
            raise _bad(where, f"'model' must be a string, got {c.get('model')!r}")
        layers = c.get("layers")
        if (not isinstance(layers, list) or not layers
                or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers)):
            raise _bad(where, f"'layers' must be a non-empty list of layer indices, got {layers!r}")
        if len(set(layers)) != len(layers):
            raise _bad(where, f"'layers' has duplicates: {layers}")
        if num_layers is not None and max(layers) >= num_layers:
            raise _bad(where, f"layer {max(layers)} does not exist in a model with {num_layers} layers")
        th = c.get("thresholds")
        if not isinstance(th, list) or len(th) != 2 or not all(_is_num(x) for x in th):
            raise _bad(where, f"'thresholds' must be two numbers [low, high], got {th!r}")
        lo, hi = float(th[0]), float(th[1])
        if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 <= lo < hi <= 1.0):
            raise _bad(where, f"'thresholds' must satisfy 0 <= low < high <= 1, got {th}")
        types = c.get("thought_types", N_THOUGHT_TYPES)
        if types not in THOUGHT_TYPE_COUNTS or isinstance(types, bool):
            raise _bad(where, f"'thought_types' must be 1 or 3, got {types!r}")
        if c.get("rule") not in RULES:
            raise _bad(where, f"'rule' must be one of {', '.join(RULES)}, got {c.get('rule')!r}")
        if not isinstance(c.get("warning", ""), str):
            raise _bad(where, "'warning' must be a string")
        rel = c.get("rel_threshold", REL_THRESHOLD)
        if not _is_num(rel) or abs(float(rel) - REL_THRESHOLD) > 1e-12:
            raise _bad(where, f"'rel_threshold' {rel!r} differs from {REL_THRESHOLD}")
        details = {k: v for k, v in c.items() if k not in _CORE}
        for k in ("n_prompts", "n_prompts_used"):
            n = details.get(k)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
                raise _bad(where, f"'{k}' must be a non-negative integer, got {n!r}")
        for k in ("target_shares", "observed_shares"):
            if k in details:
                details[k] = _shares(details[k], k, where)
        amax = c.get("kv_amax")
        return cls(model=c.get("model"), layers=tuple(int(x) for x in layers), thresholds=(lo, hi),
                   rule=c["rule"], thought_types=int(types), warning=c.get("warning", ""),
                   kv_amax=None if amax is None else KVAmax.from_dict(amax, where, num_layers),
                   details=details, rel_threshold=float(rel))

    @classmethod
    def load(cls, src: str | Path | dict[str, Any] | CalibrationArtifact, num_layers: int | None = None
             ) -> CalibrationArtifact:
        """An artifact from a JSON file, its dict, or an artifact (re-checked against ``num_layers``)."""
        if isinstance(src, CalibrationArtifact):
            src = src.to_dict()
        where = "data"
        if isinstance(src, (str, Path)):
            where = f"file {src}"
            p = Path(src)
            if not p.is_file():
                raise TrtkvError(f"calibration file {p} not found; create it with `trtkv calibrate MODEL --out {p}`")
            try:
                src = json.loads(p.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise _bad(where, f"not JSON ({e})") from None
        return cls.from_dict(src, num_layers, where)

    # --- the one writer -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "model": self.model, "sparsity_def_version": self.sparsity_def_version,
                "rel_threshold": self.rel_threshold, "layers": list(self.layers),
                "thresholds": [float(self.thresholds[0]), float(self.thresholds[1])], "rule": self.rule,
                "thought_types": self.thought_types, "warning": self.warning,
                "kv_amax": self.kv_amax.to_dict() if self.kv_amax is not None else None, **self.details}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path


def _shares(s: Any, key: str, where: str) -> dict[str, float] | None:
    if s is None:
        return None
    if not isinstance(s, dict) or set(s) != set(TYPES) or not all(_is_num(v) and 0 <= v <= 1 for v in s.values()):
        raise _bad(where, f"'{key}' must map E, R and T to shares in [0, 1], got {s!r}")
    return {k: float(s[k]) for k in ("E", "R", "T")}


# --- the JSON-level functions (what `trtkv calibrate` and older callers use) --------------------------
def load_calibration(src: str | Path | dict[str, Any] | CalibrationArtifact, num_layers: int | None = None
                     ) -> dict[str, Any]:
    """Read and validate an artifact; returns its normalised JSON form (``CalibrationArtifact.load`` for
    the typed one)."""
    return CalibrationArtifact.load(src, num_layers).to_dict()


def save_calibration(artifact: dict[str, Any] | CalibrationArtifact, path: str | Path) -> Path:
    return CalibrationArtifact.load(artifact).save(path)


def layer_scales(calibration: dict[str, Any] | CalibrationArtifact | None, fmt: str, num_layers: int) -> list:
    """Static per-layer ``LayerScales`` for format ``fmt`` from the artifact's ``kv_amax`` (1.0 without)."""
    from plugins.formats import LayerScales, get_format
    from plugins.formats.quantized import calibrate_layer_scales

    if isinstance(calibration, CalibrationArtifact):
        amax = calibration.kv_amax.to_dict() if calibration.kv_amax else None
    else:
        amax = (calibration or {}).get("kv_amax")
    if not amax:
        return [LayerScales() for _ in range(num_layers)]
    f = get_format(fmt)
    return [calibrate_layer_scales(float(k), float(v), f) for k, v in zip(amax["k"], amax["v"])]


def packaged_calibration(alias: str) -> Path | None:
    """``configs/calibration/<alias>.json`` when the repository ships one for this model alias."""
    from trtkv.paths import CONFIGS_DIR

    p = CONFIGS_DIR / "calibration" / f"{Path(alias).name}.json"
    return p if p.is_file() else None


def summary_lines(art: dict[str, Any] | CalibrationArtifact) -> list[str]:
    """Human-readable summary; the warning (if any) framed so it cannot be missed."""
    art = art.to_dict() if isinstance(art, CalibrationArtifact) else art
    sh = art.get("observed_shares") or {}
    types = art.get("thought_types", N_THOUGHT_TYPES)
    lines = [f"calibration of {art.get('model')}: rule {art['rule']}, layers {art['layers']}, "
             f"thresholds θ_low={art['thresholds'][0]:.4f} θ_high={art['thresholds'][1]:.4f}, "
             + ("3 thought types (R/E/T)" if types == 3 else "1 thought type (no labels; paper §E.10)"),
             f"  {'observed' if types == 3 else 'quantile-band'} shares on the calibration data: "
             f"E {sh.get('E', 0):.3f}  R {sh.get('R', 0):.3f}  "
             f"T {sh.get('T', 0):.3f}  ({art.get('n_prompts_used', art.get('n_prompts'))} prompts)"]
    if art.get("target_shares"):
        ts = art["target_shares"]
        lines.append(f"  target shares: E {ts['E']:.3f}  R {ts['R']:.3f}  T {ts['T']:.3f}")
    per_layer = art.get("per_layer", [])
    tri = [(d["layer"], d["three_mode_prompts"]) for d in per_layer if d["three_mode_prompts"]]
    if tri:
        best = sorted(tri, key=lambda t: (-t[1], t[0]))[:6]
        lines.append("  layers with most 3-mode prompts (layer:prompts): "
                     + ", ".join(f"{layer}:{n}" for layer, n in best))
    elif per_layer:
        counts = np.bincount(np.concatenate([np.minimum(d["modes_per_prompt"], 4) for d in per_layer]),
                             minlength=5)
        lines.append("  no (prompt, layer) has 3 modes; KDE mode counts over all pairs: "
                     + ", ".join(f"{k if k < 4 else '4+'}: {int(c)}" for k, c in enumerate(counts) if c))
    if art.get("warning"):
        bar = "!" * 78
        lines += [bar, "WARNING (calibration): " + art["warning"], bar]
    return lines
