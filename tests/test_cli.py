"""Bad input ends with one clear `trtkv: error:` line and a non-zero exit, never a traceback."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_helpers import assert_one_line_error


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "trtkv.cli", *args], capture_output=True, text=True, timeout=300, **kw)


def test_unknown_alias(tmp_path):
    assert_one_line_error(run("build", "--model", "no-such-model", "--out", str(tmp_path / "e")), "unknown model")


def test_unknown_policy_and_key(tmp_path):
    assert_one_line_error(run("build", "--model", "smollm2-135m", "--policy", "nope", "--out", str(tmp_path / "e")),
                          "unknown policy")
    assert_one_line_error(run("build", "--model", "smollm2-135m", "--policy", "streamingllm", "--set", "bogus=1",
                              "--out", str(tmp_path / "e")), "no parameter 'bogus'")
    assert_one_line_error(run("build", "--model", "smollm2-135m", "--set", "kv_format=fp5", "--out",
                              str(tmp_path / "e")), "unknown KV format")


def test_missing_engine(tmp_path):
    assert_one_line_error(run("generate", str(tmp_path / "nothing"), "--prompt", "hi"), "no engine")


def test_corrupt_engine(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "engine.json").write_text("{not json")
    assert_one_line_error(run("generate", str(d), "--prompt", "hi"), "corrupt")


@pytest.mark.model
def test_weights_hash_mismatch(engine_factory, tmp_path):
    import shutil

    src = engine_factory("smollm2-135m", "full")
    dst = tmp_path / "tampered"
    shutil.copytree(src, dst, copy_function=shutil.copy)
    w = dst / "weights" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    assert_one_line_error(run("generate", str(dst), "--prompt", "hi"), "hash mismatch")


@pytest.mark.model
@pytest.mark.parametrize("args,needle", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "99999999"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
])
def test_invalid_sampling(engine_factory, args, needle):
    eng = engine_factory("smollm2-135m", "full")
    assert_one_line_error(run("generate", str(eng), "--prompt", "hi", *args), needle)


@pytest.mark.model
def test_prompt_too_long_and_empty(engine_factory):
    eng = engine_factory("smollm2-135m", "full")
    assert_one_line_error(run("generate", str(eng), "--prompt", "word " * 9000), "positions")
    assert_one_line_error(run("generate", str(eng), "--prompt", "   "), "empty")


@pytest.mark.model
def test_generate_json(engine_factory):
    eng = engine_factory("smollm2-135m", "full")
    p = run("generate", str(eng), "--prompt", "Say hello.", "--max-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert set(out["stats"]) >= {"prompt_tokens", "generated_tokens", "kv_bytes", "kv_bytes_full", "peak_kv_bytes",
                                 "tokens_per_s"}
    assert 0 < out["stats"]["generated_tokens"] <= 8


def test_models_and_policies_list():
    p = run("models", "list", "--json")
    assert p.returncode == 0
    names = {m["name"] for m in json.loads(p.stdout)}
    assert {"smollm2-135m", "r1-llama-8b", "r1-qwen-1.5b", "r1-qwen-7b", "r1-qwen-14b"} <= names
    p = run("policies", "list", "--json")
    assert p.returncode == 0
    assert {"full", "streamingllm"} <= {d["name"] for d in json.loads(p.stdout)}


def test_bad_search_settings(engine_factory, tiny_ckpt, tmp_path):
    eng = str(engine_factory(tiny_ckpt, "arborkv"))
    out = str(tmp_path / "s")
    assert_one_line_error(run("search", eng, "--task", "chess", "--out", out), "unknown search task")
    assert_one_line_error(run("search", eng, "--task", "game24", "--branching", "0", "--out", out),
                          "branching must be a positive integer")
    assert_one_line_error(run("search", eng, "--task", "game24", "--limit", "1", "--expansions", "2",
                              "--node-tokens", "4", "--set", "kv_ratio=0.05", "--out", out), "below the root prompt")
