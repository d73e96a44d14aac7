"""The HTTP front end's request checks without a server: bounded JSON and field-by-field parsing."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from trtkv.runtime.sampling import SamplingParams
from trtkv.serve.bounded_json import BodyError, JsonLimits, parse_body, structure
from trtkv.serve.json_requests import kserve_inputs, openai_request
from trtkv.serve.protocol import RequestError, parse_request


def test_structure_ignores_brackets_inside_strings():
    assert structure(b'{"a": "[[[{{{,,,:::", "b": [1, [2]]}') == (3, 4)
    assert structure(b'{"a": "\\"[[["}') == (1, 1)


def test_deep_and_wide_bodies_refused_in_linear_time():
    deep = b'{"x":' + b"[" * 150_000 + b"]" * 150_000 + b"}"
    wide = b"{" + b",".join(b'"k%d":1' % i for i in range(100_000)) + b"}"
    for body, msg in ((deep, "nested 150001 levels"), (wide, "holds 199999 values")):
        t0 = time.perf_counter()
        with pytest.raises(BodyError, match=msg) as err:
            parse_body(body)
        assert err.value.status == 400 and time.perf_counter() - t0 < 2
    with pytest.raises(BodyError) as err:
        parse_body(b"{}" + b" " * 100, JsonLimits(max_bytes=50))
    assert err.value.status == 413


@pytest.mark.parametrize("body,msg", [(b"", "empty"), (b"  ", "empty"), (b"[1]", "got list"), (b"null", "got NoneType"),
                                      (b'{"a": 1', "not valid JSON"), (b"\xff", "not valid JSON")])
def test_not_an_object(body, msg):
    with pytest.raises(BodyError, match=msg):
        parse_body(body)


def kserve(body):
    return parse_request(kserve_inputs(body), 64, SamplingParams)


def test_kserve_strict_types_and_widths():
    p = kserve({"text_input": "hi", "max_tokens": 7, "temperature": 1, "stop": [], "stream": True, "seed": 2**40})
    assert (p.params.max_tokens, p.params.temperature, p.params.stop, p.stream, p.params.seed) == (7, 1.0, (), True,
                                                                                                   2**40)
    assert kserve({"text_input": "hi", "stop": "x"}).params.stop == ("x",)
    for body, msg in [({"text_input": "hi", "max_tokens": 2**32 + 2}, "must fit INT32"),
                      ({"text_input": "hi", "max_tokens": True}, "must be an integer"),
                      ({"text_input": "hi", "max_tokens": 2.0}, "must be an integer"),
                      ({"text_input": "hi", "max_tokens": None}, "is null"),
                      ({"text_input": "hi", "temperature": float("inf")}, "finite"),
                      ({"text_input": "hi", "ignore_eos": 1}, "true or false"),
                      ({"text_input": "hi", "stop": ["a"] * 17}, "at most 16"),
                      ({"text_input": "hi", "zzz": 1}, "unknown input 'zzz'"),
                      ({"text_input": "\ud800"}, "not valid UTF-8")]:
        with pytest.raises(RequestError, match=msg):
            kserve(body)


class Tok:
    has_chat_template = False


def oa(body, chat=False):
    return openai_request(body, chat=chat, model_name="m", max_positions=64, sampling_params=SamplingParams,
                          tokenizer=Tok())


def test_openai_requests():
    r = oa({"model": "m", "prompt": ["hi"], "max_tokens": 5, "stop": [], "n": 1, "user": "u", "stream": True,
            "stream_options": {"include_usage": True}})
    assert (r.parsed.prompt, r.parsed.params.max_tokens, r.parsed.params.chat, r.parsed.stream, r.include_usage) == \
        ("hi", 5, False, True, True)
    one = oa({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
              "max_completion_tokens": 3}, chat=True)
    assert (one.parsed.prompt, one.parsed.params.chat, one.parsed.params.max_tokens) == ("hey", True, 3)
    conv = oa({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hey"}]}, chat=True)
    assert conv.parsed.prompt == "system: be brief\nuser: hey\nassistant:" and not conv.parsed.params.chat
    for body, msg in [({"prompt": "hi"}, "model must be a string"), ({"model": "x", "prompt": "hi"}, "not served"),
                      ({"model": "m", "prompt": ["a", "b"]}, "prompt must be a string"),
                      ({"model": "m", "prompt": "hi", "n": 2}, "n=2 is not supported"),
                      ({"model": "m", "prompt": "hi", "logprobs": 3}, "logprobs=3"),
                      ({"model": "m", "prompt": "hi", "max_tokens": 65}, "between 1 and 64"),
                      ({"model": "m", "prompt": "hi", "wat": 1}, "unknown field 'wat'"),
                      ({"model": "m", "prompt": "hi", "stream_options": []}, "stream_options must be an object")]:
        with pytest.raises(RequestError, match=msg):
            oa(body)
    with pytest.raises(RequestError, match="role"):
        oa({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, chat=True)


def test_kserve_inputs_are_numpy_like_triton():
    inputs = kserve_inputs(json.loads('{"text_input": "hi", "max_tokens": 3, "top_p": 0.5, "stop": ["a"]}'))
    assert inputs["max_tokens"].dtype == np.int32 and inputs["top_p"].dtype == np.float32
    assert inputs["stop"].dtype == np.object_ and inputs["text_input"][0] == b"hi"
