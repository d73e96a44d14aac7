"""Shared fixtures: the real SmolLM2 checkpoint (fetched once into the trtkv cache), a tiny random-weight
Llama built from a config (fast), and an engine builder that caches engines per (model, policy, params)."""
from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smol_ckpt() -> Path:
    from trtkv.models.fetch import fetch
    from trtkv.models.registry import resolve_model

    return fetch(resolve_model("smollm2-135m"), quiet=True)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, smol_ckpt) -> Path:
    """A 2-layer random Llama (GQA 4/2, head_dim 16) using SmolLM2's tokenizer, saved as a local checkpoint."""
    from safetensors.torch import save_file

    from trtkv.models.config import ModelArch
    from trtkv.models.decoder import DecoderModel

    d = tmp_path_factory.mktemp("tiny-llama")
    arch = ModelArch(architecture="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
                     max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=[2])
    torch.manual_seed(0)
    model = DecoderModel(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.08)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(arch.to_hf_config()))
    for f in smol_ckpt.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy2(f, d / f.name)
    return d


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory):
    """``make(model, policy, budget=None, **settings) -> Path`` building each distinct engine once."""
    from trtkv.build.builder import build_engine

    root = tmp_path_factory.mktemp("engines")
    built: dict[tuple, Path] = {}

    def make(model, policy="full", budget=None, **settings) -> Path:
        key = (str(model), policy, budget, tuple(sorted(settings.items())))
        if key not in built:
            out = root / f"e{len(built)}"
            built[key] = build_engine(str(model), policy, out, budget=budget,
                                      settings={k: str(v) for k, v in settings.items()}, quiet=True)
        return built[key]

    return make


LOADED_ENGINES_KEPT = 6


@pytest.fixture(scope="session")
def load_engine():
    """``load(path) -> Engine``, keeping the last few loaded. Not all: every engine reserves its KV pools'
    address space (up to 2 GiB on CPU), and a process reserving more than its RAM cannot fork (the Triton
    tests fork ``tritonserver``)."""
    from collections import OrderedDict

    from trtkv.api import Engine

    cache: OrderedDict[str, Engine] = OrderedDict()

    def load(path) -> Engine:
        key = str(path)
        if key not in cache:
            cache[key] = Engine.load(path)
            while len(cache) > LOADED_ENGINES_KEPT:
                cache.popitem(last=False)[1].shutdown()
                gc.collect()
        cache.move_to_end(key)
        return cache[key]

    return load
