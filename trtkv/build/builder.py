"""``trtkv build``: resolve the model, fetch weights, fix the policy's parameters, write the engine."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
from pathlib import Path

from trtkv.version import __version__
from trtkv.artifacts.calibration import CalibrationArtifact, KVAmax
from trtkv.artifacts.engine_dir import write_manifest
from trtkv.artifacts.manifest import CacheSection, EngineManifest, ModelSection, PolicySection
from trtkv.cache.config import CacheConfig
from trtkv.errors import TrtkvError
from trtkv.models.config import ModelArch
from trtkv.models.fetch import fetch
from trtkv.models.loader import DTYPES, build_model, sha256_files, weight_files
from trtkv.models.quantized_weights import DEFAULT_GROUP_SIZE, WEIGHT_FORMATS, check_group_size, save_quantized
from trtkv.models.registry import resolve_model
from trtkv.policies import make_policy
from trtkv.settings import split_settings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def default_dtype(device: str) -> str:
    return "fp32" if device == "cpu" else "bf16"


def build_engine(model: str, policy: str, out: Path, budget: int | None = None, settings: dict[str, str] | None = None,
                 dtype: str | None = None, synthetic: bool = False, calibration: CalibrationArtifact | None = None,
                 device: str = "cpu", force: bool = True, seed: int = 0, quiet: bool = False,
                 calibration_file: str | Path | None = None, calib_prompts: int | None = None,
                 calib_max_tokens: int | None = None, weights: str = "dense", group_size: int | None = None,
                 tp: int = 1) -> Path:
    spec = resolve_model(model)
    check_tp(tp, weights)
    if weights not in WEIGHT_FORMATS:
        raise TrtkvError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if group_size is not None and weights != "int4":
        raise TrtkvError("--group-size sets int4 weights' groups; it needs --weights int4")
    group_size = (group_size or DEFAULT_GROUP_SIZE) if weights == "int4" else None
    pol_params, cache = split_settings(settings or {})
    cache = CacheConfig.validate_settings(cache)
    if budget is not None:
        pol_params["budget"] = str(budget)
    pol = make_policy(policy, pol_params)  # validates names and values before any download
    measure_formats = pol.needs_format_selection()
    if measure_formats:  # ThinKV precision=auto: calibrate scales for the paper's formats, then measure
        from trtkv.build.format_selection import DEFAULT_PRECISION

        pol.set_precision(DEFAULT_PRECISION)
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise TrtkvError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if weights != "dense" and (dtype != "fp32" or device != "cpu"):
        raise TrtkvError(f"--weights {weights} runs on CPU with fp32 activations: build it with --dtype fp32 (on CPU) "
                         "(GPU weight formats are not implemented yet)")
    pol.resolve_formats(dtype)
    from plugins.formats import get_format

    try:
        for f in pol.formats():
            get_format(f)
    except ValueError as e:
        raise TrtkvError(str(e)) from None
    needed = pol.cache_eviction_mode()  # e.g. R-KV/AMS gather-and-compact
    if needed is not None:
        if cache.get("eviction", needed) != needed:
            raise TrtkvError(f"policy {policy!r} with these parameters needs --set eviction={needed}, "
                             f"not {cache['eviction']} (see `trtkv policies list`)")
        cache["eviction"] = needed

    if out.exists() and any(out.iterdir()):
        if not force or not (out / "engine.json").exists():
            raise TrtkvError(f"{out} exists and is not an engine directory; choose another --out")
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if synthetic:
            if spec.config is None:
                raise TrtkvError(f"--synthetic-weights needs a registry alias with a known architecture, not {model!r}")
            arch_cfg, sha, src_dir = spec.config, None, None
        else:
            src_dir = fetch(spec, quiet=quiet)
            arch_cfg = json.loads((src_dir / "config.json").read_text())
            (tmp / "weights").mkdir()
            for f in weight_files(src_dir):
                _link_or_copy(f, tmp / "weights" / f.name)
            shutil.copy2(src_dir / "config.json", tmp / "weights" / "config.json")
            sha = sha256_files(weight_files(tmp / "weights"))
        arch = ModelArch.from_hf_config(arch_cfg)
        q_sha = None
        if group_size is not None:
            check_group_size(arch, group_size)
        # quantized once here; loading packs the stored codes (synthetic weights are drawn and quantized at load)
        if weights != "dense" and not synthetic:
            dense = build_model(arch, DTYPES["fp32"], "cpu", weight_files(tmp / "weights"))
            q_sha = sha256_files([save_quantized(dense, tmp, weights, group_size)])
            del dense
        tok_dir = tmp / "tokenizer"
        if src_dir is not None:
            tok_dir.mkdir()
            for name in TOKENIZER_FILES:
                if (src_dir / name).is_file():
                    shutil.copy2(src_dir / name, tok_dir / name)
        if calibration is None and (calibration_file is not None or pol.needs_calibration()):
            calibration = _policy_calibration(model, pol, synthetic, calibration_file, calib_prompts,
                                              calib_max_tokens, device, arch, quiet)
        kv_amax = calibration.kv_amax if calibration is not None else None
        if not synthetic and kv_amax is None and _quantizes(pol):
            kv_amax = _measure_kv_amax(arch, tmp)
            if calibration is not None:  # one K/V amax in the manifest, the artifact's
                calibration = dataclasses.replace(calibration, kv_amax=kv_amax)
        manifest = EngineManifest(
            model=ModelSection(alias=spec.name, source=spec.source, hf_id=spec.hf_id,
                               architecture=arch.architecture, arch=arch, dtype=dtype, weights_sha256=sha,
                               synthetic=synthetic, synthetic_seed=seed if synthetic else None,
                               weights=weights, quantized_sha256=q_sha, group_size=group_size, tp=tp),
            policy=PolicySection(pol.name, pol.params()),
            cache=CacheSection(residual_group=pol.residual_group(), **cache),
            calibration=calibration, kv_amax=kv_amax, trtkv_version=__version__,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        write_manifest(tmp, manifest)
        if measure_formats:
            _select_formats(tmp, pol, manifest, device, seed, quiet)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_tp(tp: int, weights: str) -> None:
    """``--tp N``: a positive rank count, over dense weights (the quantized decoders are not sharded)."""
    if not isinstance(tp, int) or tp < 1:
        raise TrtkvError(f"--tp must be a positive number of ranks, got {tp}")
    if tp > 1 and weights != "dense":
        raise TrtkvError(f"--tp {tp} shards dense weights; --weights {weights} runs on one rank (use --tp 1)")


def _policy_calibration(model, pol, synthetic, calibration_file, calib_prompts, calib_max_tokens, device, arch,
                        quiet) -> CalibrationArtifact:
    """The calibration the policy asked for (``needs_calibration``): a given file, the one shipped for the
    alias, or a fresh run."""
    import sys

    from trtkv.build.calibration import calibrate_for_build, summary_lines

    def log(msg: str) -> None:
        if not quiet or "WARNING" in msg or msg.startswith("!"):
            print(msg, file=sys.stderr, flush=True)

    if calibration_file is not None:
        art = CalibrationArtifact.load(calibration_file, arch.num_hidden_layers)
        for line in summary_lines(art):
            log(line)
        return art
    if synthetic:
        raise TrtkvError(f"policy {pol.name!r} with these parameters needs a calibration, and synthetic weights have "
                         "no real attention patterns: pass --calibration FILE from a real model, or --set the "
                         "parameters a calibration would fix (see `trtkv policies list`)")
    return calibrate_for_build(model, device=device, n_prompts=calib_prompts, max_tokens=calib_max_tokens,
                               num_model_layers=arch.num_hidden_layers, log=log)


def _measure_kv_amax(arch, engine_dir: Path) -> KVAmax:
    """Static K/V scales for a quantizing policy without a calibration: prefill amax over a few prompts."""
    import torch

    from trtkv.build.kv_scales import collect_kv_amax
    from trtkv.models.loader import build_model
    from trtkv.tokenizer import load_tokenizer

    model = build_model(arch, torch.float32, "cpu", weight_files(engine_dir / "weights"))
    return collect_kv_amax(model, load_tokenizer(engine_dir / "tokenizer", arch))


def _select_formats(tmp: Path, pol, manifest: EngineManifest, device: str, seed: int, quiet: bool) -> None:
    """Measure ThinKV's candidate formats on the engine being built (trtkv.build.format_selection) and write
    the choice (policy ``precision``) and its evidence (``format_selection``) into its engine.json."""
    import sys

    from trtkv.api import Engine
    from trtkv.build.format_selection import select_formats

    def log(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    engine = Engine.load(tmp, device=device, verify=False)
    sel = select_formats(engine, engine.policy, avg_bits=pol.avg_bits, seed=seed, log=log)
    for line in sel.lines():
        log(line)
    pol.set_precision(sel.precision)
    write_manifest(tmp, manifest.replace(policy=PolicySection(pol.name, pol.params()),
                                         format_selection=sel.to_dict()))


def _quantizes(policy) -> bool:
    from plugins.formats import get_format

    return any(get_format(f).quantized or get_format(f).name == "fp8" for f in policy.formats())


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
