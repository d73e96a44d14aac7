"""The ``torch`` runtime's oneDNN-packed CPU weights (trtkv/models/packed.py): the packed decoder computes
what the plain one does (to fp32 rounding: another summation order), with and without q/k/v biases, for a
decode row, a batch and a prompt chunk; engines use it by default on CPU and share one packed copy per model;
``pack_weights=False`` / ``TRTKV_PLAIN_WEIGHTS=1`` run the plain weights; greedy tokens at 16-bit storage are
the plain runtime's."""
from __future__ import annotations

import pytest
import torch
from dense_pieces import assert_pieces_match

from trtkv.api import Engine, SamplingParams
from trtkv.models.config import ModelArch
from trtkv.models.decoder import DecoderModel
from trtkv.models.packed import PackedDecoder, packed_decoder, packing_available

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _random_model(bias: bool) -> DecoderModel:
    arch = ModelArch(architecture="qwen2" if bias else "llama", hidden_size=64, intermediate_size=160,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                     max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=not bias,
                     attention_bias=bias, bos_token_id=1, eos_token_id=[2])
    g = torch.Generator().manual_seed(1)
    model = DecoderModel(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.1)
    return model.eval().fuse_projections()


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_packed_pieces_match_plain(bias):
    model = _random_model(bias)
    assert packing_available(model)
    packed = PackedDecoder(model)
    assert_pieces_match(model, packed, rows=(1, 16, 67), atol_logits=1e-5)  # a row, a batch, a chunk
    torch.testing.assert_close(packed.embed(torch.tensor([5, 7])), model.embed(torch.tensor([5, 7])))


def test_unavailable_means_plain(monkeypatch):
    model = _random_model(False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not packing_available(model)
    assert not packing_available(_random_model(False).to(torch.bfloat16))


def test_engines_pack_by_default_share_and_match_plain(tiny_ckpt, engine_factory, monkeypatch):
    from trtkv.bench import load_engines

    path = engine_factory(tiny_ckpt, "full", kv_format="fp16")
    packed, plain = Engine.load(path), Engine.load(path, pack_weights=False)
    assert isinstance(packed.core.model, PackedDecoder) and packed.core.model._model is packed.model
    assert plain.core.model is plain.model
    monkeypatch.setenv("TRTKV_PLAIN_WEIGHTS", "1")
    assert Engine.load(path).core.model.__class__ is DecoderModel
    monkeypatch.delenv("TRTKV_PLAIN_WEIGHTS")
    params = SamplingParams(max_tokens=40, ignore_eos=True, chat=False)
    prompts = ["The quick brown fox jumps over the lazy dog.", "Numbers: 1, 2, 3"]
    assert ([r.token_ids for r in packed.generate(prompts, params)]
            == [r.token_ids for r in plain.generate(prompts, params)])
    a, b = load_engines([path, path])  # one model object for both, so one packed copy
    assert a.engine.core.model is b.engine.core.model is packed_decoder(a.engine.model)
