"""Shared fixtures: the real SmolLM2 checkpoint (fetched once into the trtkv cache), a tiny random-weight
Llama built from a config with a tiny tokenizer trained here (fast, no download), and an engine builder that
caches engines per (model, policy, params)."""
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


TINY_VOCAB = 1024
# SmolLM2's chat template and special tokens (ids 0-2), so chat prompts, EOS and stop handling work as on it
TINY_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_tokenizer(d: Path) -> int:
    """A byte-level BPE tokenizer (SmolLM2's kind, ``TINY_VOCAB`` tokens) trained on trtkv's packaged text with
    the ``tokenizers`` library, written as a Hugging Face tokenizer directory; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from trtkv.paths import PACKAGE_DIR

    text = []
    for f in sorted((PACKAGE_DIR / "data").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            text += [v for v in json.loads(line).values() if isinstance(v, str)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=list(TINY_SPECIAL), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": TINY_SPECIAL[1], "eos_token": TINY_SPECIAL[2],
        "pad_token": TINY_SPECIAL[2], "unk_token": TINY_SPECIAL[0], "model_max_length": 2048}))
    (d / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    return tok.get_vocab_size()


def write_tiny_llama(d: Path, vocab_size: int) -> Path:
    """A 2-layer random Llama (GQA 4/2, head_dim 16, seed 0) as a local checkpoint in ``d`` (weights, config)."""
    from safetensors.torch import save_file

    from trtkv.models.config import ModelArch
    from trtkv.models.decoder import DecoderModel

    arch = ModelArch(architecture="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab_size,
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
    return d


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny random Llama with a tiny byte-level BPE tokenizer (``write_tiny_tokenizer``): nothing is
    downloaded, so ``pytest -m "not model"`` runs without SmolLM2."""
    d = tmp_path_factory.mktemp("tiny-llama")
    return write_tiny_llama(d, write_tiny_tokenizer(d))


@pytest.fixture(scope="session")
def tiny_smol_ckpt(tmp_path_factory, smol_ckpt) -> Path:
    """The tiny random Llama as it was recorded in tests/data (golden tokens, calibration collection): SmolLM2's
    vocabulary and tokenizer, so it needs the SmolLM2 download (tests using it are marked ``model``)."""
    d = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-smol-tokenizer"), 49152)
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
    tests fork ``tritonserver``). Engines of the same weights share one model object (``Engine.load``'s
    ``model_cache``, as the bench does; it goes with its last engine): each SmolLM2 engine held its own ~1.1 GB
    of weights and oneDNN-packed copy, and tests/test_golden_tokens.py's SmolLM2 cases peaked at 12.0 GiB RSS
    with six kept, 3.0 GiB sharing."""
    import weakref
    from collections import OrderedDict

    from trtkv.api import Engine

    cache: OrderedDict[str, Engine] = OrderedDict()
    models = weakref.WeakValueDictionary()

    def load(path) -> Engine:
        key = str(path)
        if key not in cache:
            cache[key] = Engine.load(path, model_cache=models)
            while len(cache) > LOADED_ENGINES_KEPT:
                cache.popitem(last=False)[1].shutdown()
                gc.collect()
        cache.move_to_end(key)
        return cache[key]

    return load


def pytest_terminal_summary(terminalreporter):
    """The run's peak memory (issue 38: the suite must stay within 8 GB): this pytest process's peak RSS and
    the largest peak of the child processes it waited for (servers, CLI runs)."""
    import resource

    gb = 1024 * 1024  # ru_maxrss is in KiB on Linux
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / gb
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / gb
    terminalreporter.write_line(f"peak RSS: pytest process {own:.2f} GiB, largest child process {child:.2f} GiB")
