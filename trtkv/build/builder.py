"""``trtkv build``: resolve the model, fetch weights, fix the policy's parameters, write the engine."""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from pathlib import Path
from typing import Any

from trtkv import __version__
from trtkv.build.engine_dir import write_manifest
from trtkv.errors import TrtkvError
from trtkv.models.fetch import fetch
from trtkv.models.loader import DTYPES, sha256_files, weight_files
from trtkv.models.registry import resolve_model
from trtkv.policies import make_policy

CACHE_KEYS = {"block_size": int, "eviction": str, "max_batch": int, "demote": str, "kv_memory": str,
              "host_kv_memory": str}
# tiered memory (trtkv/cache/tiers.py): settings a loaded engine also takes as overrides (bench/eval ``--set``)
TIER_CACHE_KEYS = ("demote", "kv_memory", "host_kv_memory")


def tier_cache_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Validate and normalise ``demote`` / ``kv_memory`` / ``host_kv_memory`` (sizes like 2GiB -> bytes)."""
    from trtkv.bench.runner import parse_size
    from trtkv.cache.tiers import parse_demote

    out: dict[str, Any] = {}
    for k, v in settings.items():
        if k == "demote":
            parse_demote(str(v))
            out[k] = str(v).strip().lower()
        elif k in ("kv_memory", "host_kv_memory"):
            out[k] = None if v is None or str(v).lower() in ("none", "") else (
                v if isinstance(v, int) else parse_size(str(v)))
    return out
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def split_settings(policy_name: str, settings: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """``--set`` keys go to the cache section when they name a cache setting, else to the policy."""
    cache: dict[str, Any] = {}
    pol: dict[str, str] = {}
    for k, v in settings.items():
        if k in CACHE_KEYS:
            try:
                cache[k] = CACHE_KEYS[k](v)
            except ValueError:
                raise TrtkvError(f"--set {k}={v}: expected {CACHE_KEYS[k].__name__}") from None
        else:
            pol[k] = v
    return pol, cache


def default_dtype(device: str) -> str:
    return "fp32" if device == "cpu" else "bf16"


def build_engine(model: str, policy: str, out: Path, budget: int | None = None, settings: dict[str, str] | None = None,
                 dtype: str | None = None, synthetic: bool = False, calibration: dict | None = None,
                 device: str = "cpu", force: bool = True, seed: int = 0, quiet: bool = False,
                 calibration_file: str | Path | None = None, calib_prompts: int | None = None,
                 calib_max_tokens: int | None = None) -> Path:
    spec = resolve_model(model)
    pol_params, cache = split_settings(policy, settings or {})
    if budget is not None:
        pol_params["budget"] = str(budget)
    pol = make_policy(policy, pol_params)  # validates names and values before any download
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise TrtkvError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    pol.resolve_formats(dtype)
    from plugins.formats import get_format

    try:
        for f in pol.formats():
            get_format(f)
    except ValueError as e:
        raise TrtkvError(str(e)) from None
    cache.update(tier_cache_settings({k: v for k, v in cache.items() if k in TIER_CACHE_KEYS}))
    block_size = cache.get("block_size", 8)
    if not 1 <= block_size <= 31:
        raise TrtkvError(f"--set block_size={block_size}: must be between 1 and 31")
    if cache.get("eviction", "inplace") not in ("inplace", "compact"):
        raise TrtkvError("--set eviction=...: choose inplace or compact")
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
        tok_dir = tmp / "tokenizer"
        if src_dir is not None:
            tok_dir.mkdir()
            for name in TOKENIZER_FILES:
                if (src_dir / name).is_file():
                    shutil.copy2(src_dir / name, tok_dir / name)
        from trtkv.models.config import ModelArch

        arch = ModelArch.from_hf_config(arch_cfg)
        calibration = dict(calibration or {})
        if (pol.needs_calibration() or calibration_file is not None) and not calibration:
            calibration = _thought_calibration(model, pol, synthetic, calibration_file, calib_prompts,
                                               calib_max_tokens, device, arch, quiet)
        if not synthetic and "kv_amax" not in calibration and _quantizes(pol):
            from trtkv.build.kv_scales import collect_kv_amax
            from trtkv.models.loader import build_model
            from trtkv.tokenizer import load_tokenizer

            import torch

            model = build_model(arch, torch.float32, "cpu", weight_files(tmp / "weights"))
            calibration["kv_amax"] = collect_kv_amax(model, load_tokenizer(tok_dir, arch))
            del model
        manifest = {
            "trtkv_version": __version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "model": {"alias": spec.name, "source": spec.source, "hf_id": spec.hf_id,
                      "architecture": arch.architecture, "arch": arch.to_dict(), "dtype": dtype,
                      "weights_sha256": sha, "synthetic": synthetic, "synthetic_seed": seed if synthetic else None},
            "policy": {"name": pol.name, "params": pol.params()},
            "cache": {"block_size": block_size, "eviction": cache.get("eviction", "inplace"),
                      "residual_group": pol.residual_group(), "max_batch": cache.get("max_batch", 64),
                      **{k: cache[k] for k in TIER_CACHE_KEYS if k in cache}},
            "calibration": calibration or None,
            "kernels": {"paged_attention": "triton on CUDA, torch reference on CPU",
                        "kv_write": "triton on CUDA, torch reference on CPU"},
        }
        write_manifest(tmp, manifest)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _thought_calibration(model, pol, synthetic, calibration_file, calib_prompts, calib_max_tokens, device, arch,
                         quiet) -> dict:
    """ThinKV's layers and thresholds: a given file, the calibration shipped for the alias, or a fresh run."""
    import sys

    from trtkv.build.calibration import calibrate_for_build, load_calibration, summary_lines

    def log(msg: str) -> None:
        if not quiet or "WARNING" in msg or msg.startswith("!"):
            print(msg, file=sys.stderr, flush=True)

    if calibration_file is not None:
        art = load_calibration(calibration_file, arch.num_hidden_layers)
        for line in summary_lines(art):
            log(line)
        return art
    if synthetic:
        raise TrtkvError("ThinKV on synthetic weights has no real attention patterns: pass a thought schedule "
                         "(--set thought_schedule=RRETRR...) or --calibration FILE from a real model")
    return calibrate_for_build(model, device=device, n_prompts=calib_prompts, max_tokens=calib_max_tokens,
                               num_model_layers=arch.num_hidden_layers, log=log)


def _quantizes(policy) -> bool:
    from plugins.formats import get_format

    return any(get_format(f).quantized or get_format(f).name == "fp8" for f in policy.formats())


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
