"""engine.json through EngineManifest: every malformed field is one clear line, existing (format 1) engines
load unchanged, and every cache setting is settable with --set (max_pages and kv_memory included)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_helpers import assert_one_line_error

from trtkv.build.calibration import CalibrationArtifact
from trtkv.artifacts.manifest import EngineManifest
from trtkv.errors import TrtkvError

ARCH = {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152, "head_dim": 16,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 1, "eos_token_id": [2]}
CAL = {"version": 1, "model": "m", "sparsity_def_version": "thinkv-avgrow-v1", "rel_threshold": 0.01,
       "layers": [1], "thresholds": [0.4, 0.8], "rule": "kde-valleys", "thought_types": 3, "warning": "",
       "kv_amax": {"k": [1.0, 2.0], "v": [0.5, 0.5]}, "per_layer": [], "stats": {"wall_s": 1.0}}


def _v1() -> dict:
    """A manifest exactly as `trtkv build` wrote it before the typed manifest (no max_pages/kv_memory keys)."""
    return {"format_version": 1, "trtkv_version": "0.1.0", "created": "2026-11-22T05:30:32+00:00",
            "model": {"alias": "tiny", "source": {"kind": "local"}, "hf_id": None, "architecture": "llama",
                      "arch": dict(ARCH), "dtype": "fp32", "weights_sha256": "ab" * 32, "synthetic": False,
                      "synthetic_seed": None},
            "policy": {"name": "thinkv", "params": {"budget": 1024, "thresholds": [0.4, 0.8]}},
            "cache": {"block_size": 8, "eviction": "inplace", "residual_group": 16, "max_batch": 64},
            "calibration": dict(CAL),
            "kernels": {"paged_attention": "triton on CUDA, torch reference on CPU"}}


_DELETE = object()


def _patched(section: str | None, key: str, value):
    m = _v1()
    target = m if section is None else m["model"]["arch"] if section == "model.arch" else m[section]
    if value is _DELETE:
        del target[key]
    else:
        target[key] = value
    return m


def test_format_1_engines_load_and_round_trip():
    m = EngineManifest.from_dict(_v1())
    assert m.model.arch.num_hidden_layers == 2 and m.policy.name == "thinkv"
    assert (m.cache.max_pages, m.cache.kv_memory, m.cache.residual_group) == (None, None, 16)
    assert isinstance(m.calibration, CalibrationArtifact) and m.kv_amax.k == (1.0, 2.0)
    again = EngineManifest.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m
    out = m.to_dict()
    assert out["calibration"] == CAL and out["model"] == _v1()["model"]


def test_kv_amax_only_calibration():
    """Quantizing policies without a thought calibration keep only the build-time K/V amax."""
    raw = _v1()
    raw["calibration"] = {"kv_amax": {"k": [1.0, 2.0], "v": [3.0, 4.0], "n_prompts": 8, "source": "prefill"}}
    m = EngineManifest.from_dict(raw)
    assert m.calibration is None and m.kv_amax.v == (3.0, 4.0) and m.kv_amax.n_prompts == 8
    assert m.to_dict()["calibration"] == raw["calibration"]


@pytest.mark.parametrize("section,key,value,needle", [
    (None, "format_version", 2, "format version 2"),
    (None, "model", _DELETE, "'model' section"),
    (None, "cache", [], "'cache' section"),
    ("model", "alias", 3, "model.alias"),
    ("model", "dtype", "fp8", "model.dtype"),
    ("model", "arch", _DELETE, "model.arch"),
    ("model", "weights_sha256", None, "model.weights_sha256"),
    ("model", "synthetic", "yes", "model.synthetic"),
    ("model", "synthetic_seed", "x", "model.synthetic_seed"),
    ("model.arch", "hidden_size", "64", "model.arch.hidden_size"),
    ("model.arch", "num_hidden_layers", 0, "model.arch.num_hidden_layers"),
    ("model.arch", "vocab_size", _DELETE, "model.arch.vocab_size"),
    ("model.arch", "architecture", "gpt2", "unsupported architecture"),
    ("model.arch", "num_key_value_heads", 3, "multiple of num_key_value_heads"),
    ("policy", "name", None, "policy.name"),
    ("policy", "params", [1], "policy.params"),
    ("cache", "block_size", 40, "block_size"),
    ("cache", "block_size", "8", None),  # strings are parsed like --set values
    ("cache", "eviction", "lru", "eviction"),
    ("cache", "max_batch", 0, "max_batch"),
    ("cache", "max_pages", -1, "max_pages"),
    ("cache", "kv_memory", "lots", "kv_memory"),
    ("cache", "residual_group", 0, "cache.residual_group"),
    ("cache", "surprise", 1, "unknown cache setting"),
    (None, "calibration", "x", "calibration must be an object"),
    (None, "calibration", {**CAL, "thresholds": [0.8, 0.4]}, "thresholds"),
    (None, "calibration", {**CAL, "layers": [5]}, "does not exist"),
    (None, "calibration", {**CAL, "kv_amax": {"k": [1.0], "v": [1.0]}}, "kv_amax"),
    (None, "kernels", {"paged_attention": 1}, "kernels"),
])
def test_malformed_field_is_one_clear_line(section, key, value, needle):
    raw = _patched(section, key, value)
    if needle is None:
        assert EngineManifest.from_dict(raw).cache.block_size == 8
        return
    with pytest.raises(TrtkvError) as e:
        EngineManifest.from_dict(raw)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg
    assert msg.endswith(("rebuild the engine", "rerun `trtkv calibrate`")), msg


def run(*args):
    return subprocess.run([sys.executable, "-m", "trtkv.cli", *args], capture_output=True, text=True, timeout=300)


def test_info_prints_the_manifest_and_rejects_a_malformed_one(tmp_path):
    d = tmp_path / "e"
    d.mkdir()
    (d / "engine.json").write_text(json.dumps(_v1()))
    p = run("info", str(d))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == EngineManifest.from_dict(_v1()).to_dict()
    (d / "engine.json").write_text(json.dumps(_patched("cache", "max_pages", "many")))
    assert_one_line_error(run("info", str(d)), "max_pages")


def test_set_max_pages_and_kv_memory_at_build_and_load(tiny_ckpt, engine_factory):
    from trtkv.api import Engine
    from trtkv.artifacts.engine_dir import read_manifest

    path = engine_factory(tiny_ckpt, "full", max_pages=64, kv_memory="2GiB", max_batch=3, block_size=16)
    c = read_manifest(path).cache
    assert (c.max_pages, c.kv_memory, c.max_batch, c.block_size) == (64, 2 * 2**30, 3, 16)
    eng = Engine.load(path)
    cfg = eng.core.cache.cfg
    assert (cfg.max_pages, cfg.kv_memory, cfg.block_size, eng.scheduler.max_batch) == (64, 2 * 2**30, 16, 3)
    eng = Engine.load(path, cache_overrides={"kv_memory": "512MiB", "max_pages": "none"})
    assert (eng.core.cache.cfg.kv_memory, eng.core.cache.cfg.max_pages) == (512 * 2**20, None)
    with pytest.raises(TrtkvError, match="fixed when the engine is built"):
        Engine.load(path, cache_overrides={"block_size": 8})
    with pytest.raises(TrtkvError, match="kv_memory"):
        Engine.load(path, cache_overrides={"kv_memory": "-3GB"})


def test_cache_settings_on_the_command_line(tiny_ckpt, tmp_path):
    out = tmp_path / "e"
    p = run("build", "--model", str(tiny_ckpt), "--out", str(out), "--kv-memory", "1GiB", "--set", "max_pages=32")
    assert p.returncode == 0, p.stderr
    c = json.loads(run("info", str(out)).stdout)["cache"]
    assert (c["kv_memory"], c["max_pages"]) == (2**30, 32)
    for args, needle in ((["--set", "max_pages=abc"], "max_pages"), (["--kv-memory", "lots"], "kv_memory"),
                         (["--set", "block_size=0"], "block_size"),
                         (["--kv-memory", "1GiB", "--set", "kv_memory=2GiB"], "once")):
        assert_one_line_error(run("build", "--model", str(tiny_ckpt), "--out", str(tmp_path / "x"), *args), needle)
    assert_one_line_error(run("generate", str(out), "--prompt", "hi", "--kv-memory", "0"), "kv_memory")
    p = run("generate", str(out), "--prompt", "hi", "--max-tokens", "4", "--kv-memory", "256MiB", "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["token_ids"]) <= 4
