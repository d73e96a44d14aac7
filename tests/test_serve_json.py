"""The HTTP front end's request checks without a server: bounded JSON and field-by-field parsing."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from trtkv.runtime.sampling import SamplingParams
from trtkv.serve.bounded_json import BodyError, JsonLimits, parse_body, structure
from trtkv.serve.json_requests import kserve_inputs, openai_request
from trtkv.serve.protocol import RequestError, parse_request


def test_structure_ignores_brackets_inside_strings():
    assert structure(b'{"a": "[[[{{{,,,:::", "b": [1, [2]]}') == (3, 4)
    assert structure(b'{"a": "\\"[[["}') == (1, 1)
    assert structure(b'{"a": "\\\\", "b": [1]}') == (2, 3)  # an escaped backslash ends the string
    assert structure(b'{"a": "\\\\\\"[", "b": [1]}') == (2, 3)  # \\ then \" : still inside
    assert structure(b'') == (0, 0) and structure(b'[[]]') == (2, 0)


def _reference_structure(body: bytes) -> tuple[int, int]:
    """A byte-by-byte JSON string scanner: what `structure` computes, one loop iteration per byte."""
    depth = deepest = values = 0
    inside = escaped = False
    for c in body.decode("utf-8"):
        if inside:
            escaped, inside = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            inside = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
        elif c in ",:":
            values += 1
    return deepest, values


def test_structure_equals_a_byte_by_byte_scan_on_valid_json():
    rng = random.Random(38)
    alphabet = ['"', "\\", "[", "]", "{", "}", ",", ":", "a", " ", "\u00e9", "\n"]

    def value(depth):
        r = rng.random()
        if depth > 4 or r < 0.3:
            return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {value(9): value(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(2000):
        body = json.dumps(value(0), ensure_ascii=rng.random() < 0.5).encode()
        assert structure(body) == _reference_structure(body), body


ADVERSARIAL = {  # 4 MiB each: the body limit
    "unterminated string of \\\" pairs": b'{"text_input": "' + b'\\"' * (2 << 20),
    "quotes": b'"' * (4 << 20),
    "backslashes": b"\\" * (4 << 20),
    "brackets": b"[" * (4 << 20),
    "nested": b'{"x":' + b"[" * 150_000 + b"]" * 150_000 + b"}",
    "wide": b"{" + b",".join(b'"k%d":1' % i for i in range(100_000)) + b"}",
}


def test_adversarial_bodies_refused_by_a_linear_check():
    """Every 4 MiB adversarial body is refused with a 400 in one subprocess, which must finish: the regex this
    replaced needed 12 s for 80 KB of \\" pairs and hours for 4 MiB (the timeout is a hang guard, 100x the need)."""
    script = ("import sys\nfrom trtkv.serve.bounded_json import BodyError, parse_body\n"
              "for name, body in eval(sys.stdin.read()).items():\n"
              "    body = body[: 4 << 20]\n"
              "    try:\n        parse_body(body)\n    except BodyError as e:\n"
              "        print(name, '|', e.status, '|', str(e)[:60])\n")
    run = subprocess.run([sys.executable, "-c", script], input=repr(ADVERSARIAL), capture_output=True, text=True,
                         timeout=120)
    lines = dict(line.split(" | ", 1) for line in run.stdout.splitlines())
    assert set(lines) == set(ADVERSARIAL), run.stderr[-2000:]
    assert lines["unterminated string of \\\" pairs"].startswith("400 | request body is not valid JSON")
    assert lines["nested"] == "400 | JSON nested 150001 levels deep; the limit is 16"
    assert lines["wide"] == "400 | JSON holds 199999 values; the limit is 4096"
    assert lines["brackets"].startswith("400 | JSON nested 4194304 levels")


def test_deep_and_wide_bodies_refused():
    deep = b'{"x":' + b"[" * 150_000 + b"]" * 150_000 + b"}"
    wide = b"{" + b",".join(b'"k%d":1' % i for i in range(100_000)) + b"}"
    for body, msg in ((deep, "nested 150001 levels"), (wide, "holds 199999 values")):
        with pytest.raises(BodyError, match=msg) as err:
            parse_body(body)
        assert err.value.status == 400
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
                      ({"text_input": "hi", "stop": ["a" * 257]}, "at most 256 characters"),
                      ({"text_input": "hi", "stop": ["ok", "\ud800"]}, "stop holds a lone surrogate"),
                      ({"text_input": "hi", "stop": "\udfff"}, "stop holds a lone surrogate"),
                      ({"text_input": "\ud800"}, "text_input holds a lone surrogate")]:
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
                      ({"model": "m", "prompt": "a\ud800"}, "prompt holds a lone surrogate"),
                      ({"model": "m", "prompt": "hi", "stop": ["\ud800"]}, "stop holds a lone surrogate"),
                      ({"model": "m", "prompt": " "}, "prompt is empty"),
                      ({"model": "m", "prompt": "hi", "max_tokens": 0}, "^max_tokens must be between"),
                      ({"model": "m", "prompt": "hi", "n": True}, "n=True is not supported"),
                      ({"model": "m", "prompt": "hi", "logprobs": True}, "logprobs=True"),
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


def test_openai_neutral_values_and_field_names():
    """chat `logprobs: false` is the neutral value (was a 400); errors name the field the client sent."""
    user = [{"role": "user", "content": "hey"}]
    r = oa({"model": "m", "messages": user, "logprobs": False, "top_logprobs": 0, "n": 1, "presence_penalty": 0.0,
            "tools": [], "response_format": {"type": "text"}, "parallel_tool_calls": True}, chat=True)
    assert r.parsed.prompt == "hey"
    assert oa({"model": "m", "prompt": "hi", "logprobs": None, "echo": False}).parsed.prompt == "hi"
    for body, msg, param in [
            ({"model": "m", "messages": user, "max_completion_tokens": 0}, "^max_completion_tokens must be between",
             "max_completion_tokens"),
            ({"model": "m", "messages": user, "max_tokens": 65}, "^max_tokens must be between", "max_tokens"),
            ({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]},
             r"^messages\[0\]\.content holds a lone surrogate", "messages[0].content"),
            ({"model": "m", "messages": [{"role": "user", "content": ""}]}, "^messages hold no text", "messages"),
            ({"model": "m", "messages": user, "temperature": "hot"}, "^temperature must be a number", "temperature"),
            ({"model": "m", "messages": user, "stop": ["x"] * 17}, "^stop holds 17 strings", "stop")]:
        with pytest.raises(RequestError, match=msg) as err:
            oa(body, chat=True)
        assert err.value.param == param and "text_input" not in str(err.value)


def test_kserve_inputs_are_numpy_like_triton():
    inputs = kserve_inputs(json.loads('{"text_input": "hi", "max_tokens": 3, "top_p": 0.5, "stop": ["a"]}'))
    assert inputs["max_tokens"].dtype == np.int32 and inputs["top_p"].dtype == np.float32
    assert inputs["stop"].dtype == np.object_ and inputs["text_input"][0] == b"hi"
