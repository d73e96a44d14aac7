"""Orchestration: the prompts, a temporary full-cache engine, collection, raw data on disk, analysis,
the artifact — what ``trtkv calibrate`` and ``trtkv build --policy thinkv`` call.

Why a temporary engine: the statistic must come from exact KV, so calibration always runs the ``full``
policy at an unquantized dtype, even when given a quantized engine (its weights are reused through links).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from trtkv.build.calibration.analysis import DEFAULT_NUM_LAYERS, analyze
from trtkv.artifacts.calibration import CalibrationArtifact, packaged_calibration, summary_lines
from trtkv.build.calibration.artifact import build_artifact
from trtkv.build.calibration.collect import DEFAULT_MIN_KEYS, CalibrationData, Log, collect_sparsity
from trtkv.errors import TrtkvError


class _FullEngine:
    """Context manager: a FullKV ``Engine`` for ``model`` (alias, checkpoint dir or engine dir) in a
    temporary directory that is removed afterwards. An existing engine is re-used through a copy of its
    manifest with the ``full`` policy at the model's dtype (so a quantized engine calibrates on exact KV)."""

    def __init__(self, model: str, device: str | None = None, dtype: str | None = None, synthetic: bool = False,
                 seed: int = 0, quiet: bool = True):
        self.model, self.device, self.dtype = model, device, dtype
        self.synthetic, self.seed, self.quiet = synthetic, seed, quiet
        self.tmp: Path | None = None
        self.alias = model
        self.weights_sha256 = None

    def __enter__(self):
        import torch

        from trtkv.api import Engine
        from trtkv.artifacts.engine_dir import read_manifest, write_manifest
        from trtkv.artifacts.manifest import PolicySection

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tmp = Path(tempfile.mkdtemp(prefix="trtkv-calib-"))
        src = Path(self.model).expanduser()
        path = self.tmp / "engine"
        if src.is_dir() and (src / "engine.json").is_file():
            m = read_manifest(src)
            m = m.replace(policy=PolicySection("full", {}), calibration=None, kv_amax=None,
                          cache=dataclasses.replace(m.cache, residual_group=1, eviction="inplace", max_pages=None))
            path.mkdir()
            for sub in ("weights", "tokenizer"):
                if (src / sub).exists():
                    (path / sub).symlink_to((src / sub).resolve(), target_is_directory=True)
            write_manifest(path, m)
        else:
            from trtkv.build.builder import build_engine, default_dtype

            build_engine(self.model, "full", path, dtype=self.dtype or default_dtype(device),
                         synthetic=self.synthetic, device=device, seed=self.seed, quiet=self.quiet)
        eng = Engine.load(path, device=device)
        self.alias = eng.manifest.model.alias
        self.weights_sha256 = eng.manifest.model.weights_sha256
        return eng

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def open_full_engine(model: str, device: str | None = None, dtype: str | None = None, synthetic: bool = False,
                     seed: int = 0, quiet: bool = True) -> _FullEngine:
    return _FullEngine(model, device, dtype, synthetic, seed, quiet)


def load_prompts(n: int, data: str | Path | None = None) -> tuple[list[str], list[str]]:
    """The first ``n`` calibration prompts (``load_task("calibration")``; ``data`` overrides the file)."""
    from trtkv.eval.datasets import DataFileNotFoundError, load_task

    if n < 1:
        raise TrtkvError(f"--prompts must be positive, got {n}")
    try:
        probs = load_task("calibration", data, limit=n)
    except DataFileNotFoundError as e:
        raise TrtkvError(str(e)) from None
    except (KeyError, ValueError) as e:
        raise TrtkvError(f"cannot read calibration prompts from {data}: {e}") from None
    if not probs:
        raise TrtkvError(f"no calibration prompts in {data or 'the calibration set'}")
    return [p.question for p in probs], [p.id for p in probs]


def save_raw(data: CalibrationData, path: str | Path) -> Path:
    """The recorded per-step sparsities and K/V amax as ``.npz`` (re-analyse with ``trtkv calibrate
    --from-raw`` without generating again)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"u_{i}": x for i, x in enumerate(data.u)}
    arrays.update({f"steps_{i}": x for i, x in enumerate(data.steps)})
    meta = {**data.meta, "prompt_ids": data.prompt_ids, "generated_tokens": data.generated_tokens,
            "n": len(data.u)}
    with open(path, "wb") as f:
        np.savez_compressed(f, k_amax=data.k_amax, v_amax=data.v_amax, meta=np.array(json.dumps(meta)), **arrays)
    return path


def load_raw(path: str | Path) -> CalibrationData:
    try:
        z = np.load(Path(path), allow_pickle=False)
        meta = json.loads(str(z["meta"]))
        n = int(meta.pop("n"))
        u = [z[f"u_{i}"] for i in range(n)]
        steps = [z[f"steps_{i}"] for i in range(n)]
        ids, gen = meta.pop("prompt_ids"), meta.pop("generated_tokens")
        return CalibrationData(u, steps, z["k_amax"], z["v_amax"], ids, gen, meta)
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise TrtkvError(f"cannot read raw calibration data {path}: {e}") from None


def _collect(model, n_prompts, max_tokens, stride, min_keys, batch_size, temperature, seed, data, device, dtype,
             synthetic, quiet, log) -> tuple[CalibrationData, str, dict[str, Any]]:
    import torch

    prompts, ids = load_prompts(n_prompts, data)
    if batch_size is None:
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        batch_size = 32 if dev.startswith("cuda") else 8
    opener = open_full_engine(model, device, dtype, synthetic, seed, quiet)
    with opener as eng:
        if log:
            log(f"[calibrate] {opener.alias}: {len(prompts)} prompts x {max_tokens} tokens, stride {stride}, "
                f"min_keys {min_keys}, batch {batch_size}, {eng.manifest.model.dtype} on {eng.core.device}")
        cdata = collect_sparsity(eng, prompts, max_tokens, stride, min_keys, batch_size, temperature, seed, ids, log)
        extra = {"weights_sha256": opener.weights_sha256, "dtype": str(eng.core.dtype).replace("torch.", ""),
                 "device": str(eng.core.device)}
    cdata.meta.update(model=opener.alias, **extra)
    return cdata, opener.alias, extra


def calibrate(model: str, n_prompts: int = 100, max_tokens: int = 1024, stride: int = 1,
              num_layers: int = DEFAULT_NUM_LAYERS, data: str | Path | None = None,
              min_keys: int = DEFAULT_MIN_KEYS, batch_size: int | None = None, temperature: float | None = None,
              seed: int = 0, target_shares: dict[str, float] | None = None, min_support: float = 0.5,
              device: str | None = None, dtype: str | None = None, synthetic: bool = False,
              plot: str | Path | None = None, log: Log | None = None, quiet: bool = True,
              raw_out: str | Path | None = None, raw_in: str | Path | None = None,
              fallback_types: int = 1) -> dict[str, Any]:
    """Collect on ``model`` and analyse; returns the artifact's JSON form (and writes ``plot`` if given).

    ``raw_out`` also saves the recorded data (:func:`save_raw`); ``raw_in`` skips the collection and
    re-analyses saved data (``model`` then only names the model in the artifact)."""
    t0 = time.perf_counter()
    if raw_in is not None:
        cdata = load_raw(raw_in)
        alias = str(cdata.meta.get("model") or model)
        extra = {k: cdata.meta.get(k) for k in ("weights_sha256", "dtype", "device")}
    else:
        cdata, alias, extra = _collect(model, n_prompts, max_tokens, stride, min_keys, batch_size, temperature,
                                       seed, data, device, dtype, synthetic, quiet, log)
        if raw_out is not None:
            save_raw(cdata, raw_out)
    an = analyze(cdata.u, num_layers, target_shares, min_support, keep_per_prompt=plot is not None,
                 fallback_types=fallback_types)
    art = build_artifact(an, cdata, alias, {**extra, "num_layers_requested": num_layers,
                                            "min_support": min_support}).to_dict()
    art["stats"]["wall_s"] = round(time.perf_counter() - t0, 2)
    if plot is not None:
        from trtkv.build.calibration_plot import plot_calibration

        plot_calibration(art, plot, an.per_prompt_kde)
    return art


def calibrate_for_build(model: str, *, device: str = "cpu", dtype: str | None = None, synthetic: bool = False,
                        seed: int = 0, n_prompts: int | None = None, max_tokens: int | None = None,
                        stride: int = 1, num_layers: int = DEFAULT_NUM_LAYERS, data: str | Path | None = None,
                        target_shares: dict[str, float] | None = None, reuse: bool = True,
                        num_model_layers: int | None = None, log: Log | None = None,
                        quiet: bool = True) -> CalibrationArtifact:
    """The calibration ``trtkv build`` embeds in ``engine.json`` when the policy needs one and no file is given.

    With ``reuse`` (default) and real weights, a calibration the repository ships for this alias
    (``configs/calibration/<alias>.json``) is returned as is; otherwise a fresh one is run, sized for the
    device when not given: 16 prompts × 192 tokens on CPU, 100 prompts × 2,048 tokens on CUDA (the paper
    uses 100 s1K prompts and up to 32K tokens). Any warning is printed through ``log``."""
    if reuse and not synthetic:
        p = packaged_calibration(model)
        if p is not None:
            art = CalibrationArtifact.load(p, num_model_layers)
            if log:
                log(f"[calibrate] using the shipped calibration {p}")
                for line in summary_lines(art):
                    log(line)
            return art
    cuda = str(device).startswith("cuda")
    art = CalibrationArtifact.load(
        calibrate(model, n_prompts or (100 if cuda else 16), max_tokens or (2048 if cuda else 192), stride,
                  num_layers, data, device=device, dtype=dtype, synthetic=synthetic, seed=seed,
                  target_shares=target_shares, log=log, quiet=quiet), num_model_layers)
    if log:
        for line in summary_lines(art):
            log(line)
    return art
