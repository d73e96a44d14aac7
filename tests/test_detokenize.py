"""Incremental detokenization (issue 13): the text of a growing output is built from a short window per token,
equals a full decode (multi-byte characters included), and a step decodes as few tokens at token 2,048 as at
token 1 (counted, not timed)."""
from __future__ import annotations

import pytest

from trtkv.runtime.request import IncrementalDetokenizer

TEXT = ("Reasoning models write thousands of tokens — «naïve» café, 数学の証明, emoji 🧮🔢 and math: ∑ᵢ xᵢ² ≥ 0. "
        "Let me think step by step about 12 × 37 = 444, then verify: 444 / 12 = 37. ")


@pytest.fixture(scope="module")
def tok(smol_ckpt):
    from trtkv.models.config import ModelArch
    from trtkv.tokenizer import load_tokenizer
    import json

    arch = ModelArch.from_hf_config(json.loads((smol_ckpt / "config.json").read_text()))
    return load_tokenizer(smol_ckpt, arch)


def _run(tok, ids):
    """(detokenizer, tokens decoded at each step, text after each step)."""
    decoded = []

    def decode(window):
        decoded[-1] += len(window)
        return tok.decode(window)

    det = IncrementalDetokenizer(decode)
    texts = []
    for n in range(1, len(ids) + 1):
        decoded.append(0)
        texts.append(det.push(ids[:n]))
    return det, decoded, texts


@pytest.mark.model
def test_equals_full_decode_with_multibyte_characters(tok):
    ids = tok.encode(TEXT * 3)
    det, _, texts = _run(tok, ids)
    assert det.text == tok.decode(ids)
    for a, b in zip(texts, texts[1:]):  # append-only: streamed deltas are never taken back
        assert b.startswith(a)
    assert "\ufffd" not in det.text


@pytest.mark.model
def test_cost_per_step_is_flat_over_2048_tokens(tok):
    ids = (tok.encode(TEXT) * 200)[:2048]
    det, decoded, _ = _run(tok, ids)
    assert det.text == tok.decode(ids)
    # a full re-decode per step decodes n tokens at step n (2,048 at the end); the window a handful at every step
    assert max(decoded) <= 24 and max(decoded[-256:]) <= max(decoded[:256]), (max(decoded[:256]), max(decoded))
    assert sum(decoded) <= 12 * len(ids)


def test_skipped_special_tokens_keep_the_window_short():
    det = IncrementalDetokenizer(lambda ids: "".join("x" if i else "" for i in ids))
    ids = [1] + [0] * 500 + [1]
    for n in range(1, len(ids) + 1):
        det.push(ids[:n])
    assert det.text == "xx" and det.read - det.prefix <= 6


def test_engine_text_is_decoded_when_read_and_cut_at_stop_strings(engine_factory, load_engine, tiny_ckpt):
    """A request's text is decoded when read (a step that nobody reads decodes nothing) and is what a full decode
    of its ids gives; a stop string found in it ends the request and cuts the text before it, on the offline and
    the streaming path alike, and later reads do not bring the cut-off text back."""
    from trtkv.runtime.sampling import SamplingParams

    eng = load_engine(engine_factory(tiny_ckpt))
    [free] = eng.generate("hello world", SamplingParams(max_tokens=24, ignore_eos=True))
    assert free.text == eng.core.decode_text(free.token_ids) and free.finish_reason == "length"
    cut = next(i for i in range(1, len(free.text)) if free.text[i:i + 2].isalpha())  # (text before: U+FFFD)
    stop = free.text[cut:cut + 2]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    [out] = eng.generate("hello world", params)
    assert out.finish_reason == "stop" and out.text == free.text[:cut]
    assert out.token_ids == free.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    streamed = list(eng.stream("hello world", params))
    assert "".join(ev.text for ev in streamed) == out.text and streamed[-1].result.text == out.text
