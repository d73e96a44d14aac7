"""JSON request bodies of trtkv's HTTP front end, checked field by field before the engine sees them.

Two dialects arrive as JSON: KServe v2's generate extension (field names are the model's inputs,
`protocol.INPUTS`) and OpenAI's `/v1/completions` and `/v1/chat/completions`.  Both become a
`protocol.ParsedRequest`; every type, range and integer-width problem is a `RequestError` with one
line naming the field as the client's API spells it (OpenAI's `prompt`/`messages`, not KServe's
`text_input`), so no body can reach the engine half-checked or wrap an integer (`max_tokens`
4294967298 is refused, not taken as 2).  Every string must be valid Unicode: JSON can spell a lone
surrogate (`"\\ud800"`), which cannot be encoded; it is a 400 naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtkv.serve import protocol
from trtkv.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, RequestError, check_encodable

INT_RANGES = {"INT32": (-(2**31), 2**31 - 1), "INT64": (-(2**63), 2**63 - 1)}
MAX_MESSAGES = 256


def _type_name(value: Any) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _param(name: str) -> str:
    return name.split("[")[0].split(".")[0]


def _integer(name: str, value: Any, dtype: str = "INT64") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {_type_name(value)} {value!a}"[:200], _param(name))
    lo, hi = INT_RANGES[dtype]
    if not lo <= value <= hi:
        raise RequestError(f"{name} must fit {dtype} ({lo}..{hi}), got {value}", _param(name))
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {_type_name(value)} {value!a}"[:200], _param(name))
    value = float(value)
    if not math.isfinite(value):
        raise RequestError(f"{name} must be finite, got {value}", _param(name))
    return value


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {_type_name(value)} {value!a}"[:200], _param(name))
    return value


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {_type_name(value)}", _param(name))
    return check_encodable(name, value)


def _stop(value: Any) -> np.ndarray:
    """The stop strings as the BYTES tensor the model takes (bounded like every other way in)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise RequestError(f"stop must be a string or an array of strings, got {_type_name(value)}", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds {len(items)} strings; at most {MAX_STOP_STRINGS}", "stop")
    out = [_string("stop", s) for s in items]
    if any(len(s) > MAX_STOP_CHARS for s in out):
        raise RequestError(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
    return np.array([s.encode("utf-8") for s in out], dtype=np.object_)


# ---- KServe v2 generate extension ----------------------------------------------------------------

def kserve_inputs(body: dict[str, Any]) -> dict[str, np.ndarray]:
    """The input tensors Triton would have built from a generate body, with strict JSON types."""
    ios = {io.name: io for io in protocol.INPUTS}
    inputs: dict[str, np.ndarray] = {}
    for name, value in body.items():
        if name in ("id", "parameters"):  # KServe envelope fields: nothing to take from them
            continue
        io = ios.get(name)
        if io is None:
            raise RequestError(f"unknown input {name!a}; the model takes {', '.join(sorted(ios))}"[:300])
        if value is None:
            raise RequestError(f"{name} is null; leave it out to use the default", name)
        if name == "stop":
            inputs[name] = _stop(value)
            continue
        if io.dtype == "STRING":
            scalar: Any = _string(name, value).encode("utf-8")
        elif io.dtype in INT_RANGES:
            scalar = _integer(name, value, io.dtype)
        elif io.dtype == "FP32":
            scalar = _number(name, value)
            if abs(scalar) > float(np.finfo(np.float32).max):
                raise RequestError(f"{name} does not fit FP32, got {scalar}", name)
        else:
            scalar = _boolean(name, value)
        inputs[name] = np.array([scalar], dtype=protocol.NUMPY_DTYPES[io.dtype])
    return inputs


# ---- OpenAI completions / chat completions ---------------------------------------------------------

# Accepted for client compatibility when they ask for nothing trtkv does not do: field -> its neutral values
# (null is neutral for all of them).  Compared with types: `"n": true` is not `"n": 1`.
_NEUTRAL: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "logprobs": (False,),  # chat: a boolean; completions: an integer or null
    "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
}
# Bookkeeping fields that do not change the generation: accepted with any value.
_IGNORED = ("user", "metadata", "store", "service_tier")


def _is_neutral(name: str, value: Any) -> bool:
    def same(a, b):
        if isinstance(a, bool) or isinstance(b, bool):
            return type(a) is type(b) and a == b
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a == b
        return type(a) is type(b) and a == b

    return value is None or any(same(value, n) for n in _NEUTRAL[name])


@dataclass
class OpenAIRequest:
    parsed: protocol.ParsedRequest
    model: str
    include_usage: bool


def render_chat(tokenizer, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """(prompt, apply the engine's chat template?) for a message list.

    One user message goes through the engine's own template path (identical tokens to
    `engine.generate(..., chat=True)`); longer conversations are rendered here with the tokenizer's
    chat template, or as "role: content" lines when the model has none.
    """
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"], True
    tok = getattr(tokenizer, "tok", None)
    if tok is not None and getattr(tokenizer, "has_chat_template", False):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:", False


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty array of {role, content} objects", "messages")
    if len(value) > MAX_MESSAGES:
        raise RequestError(f"messages holds {len(value)} entries; at most {MAX_MESSAGES}", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object, got {_type_name(m)}", "messages")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise RequestError(f"messages[{i}].role must be system, user or assistant, got {role!r}"[:200], "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}}",
                                       "messages")
                parts.append(part["text"])
            content = "".join(parts)
        content = _string(f"messages[{i}].content", content)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def openai_request(body: dict[str, Any], *, chat: bool, model_name: str, max_positions: int,
                   sampling_params: type, tokenizer=None) -> OpenAIRequest:
    """Validate an OpenAI (chat) completion body into a ParsedRequest; errors name OpenAI's fields."""
    body = dict(body)
    model = body.pop("model", None)
    if not isinstance(model, str):
        raise RequestError(f"model must be a string naming the served model ({model_name!r})", "model")
    if model != model_name:
        raise RequestError(f"model {model!r}"[:120] + f" is not served here; use {model_name!r}", "model")
    names = {"text_input": "messages" if chat else "prompt"}
    if chat:
        prompt, use_template = render_chat(tokenizer, _messages(body.pop("messages", None)))
    else:
        prompt = body.pop("prompt", None)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string (or an array holding one string)", "prompt")
        prompt = check_encodable("prompt", prompt)
        use_template = False  # completions continue raw text, as OpenAI's do
    if not prompt.strip():
        raise RequestError("messages hold no text" if chat else "prompt is empty", names["text_input"])

    fields: dict[str, Any] = {}
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.pop(max_name, None)
    body.pop("max_tokens", None)
    body.pop("max_completion_tokens", None)
    names["max_tokens"] = max_name
    if max_tokens is not None:
        fields["max_tokens"] = _integer(max_name, max_tokens)
    for name in ("temperature", "top_p", "repetition_penalty"):
        if body.get(name) is not None:
            fields[name] = _number(name, body.pop(name))
        body.pop(name, None)
    for name in ("top_k", "seed"):
        if body.get(name) is not None:
            fields[name] = _integer(name, body.pop(name))
        body.pop(name, None)
    stop = body.pop("stop", None)
    stream = _boolean("stream", body.pop("stream", False) or False)
    ignore_eos = _boolean("ignore_eos", body.pop("ignore_eos", False) or False)
    options = body.pop("stream_options", None)
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    include_usage = _boolean("stream_options.include_usage", options.get("include_usage", False))
    for name, value in body.items():
        if name in _IGNORED:
            continue
        if name not in _NEUTRAL:
            raise RequestError(f"unknown field {name!r}"[:120] + " (trtkv supports model, prompt/messages, "
                               "max_tokens, temperature, top_p, top_k, seed, stop, stream, repetition_penalty)",
                               _param(name))
        if not _is_neutral(name, value):
            raise RequestError(f"{name}={value!r}"[:120] + " is not supported by trtkv", name)

    inputs = {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_)}
    inputs.update(kserve_inputs(fields))
    if stop is not None:
        inputs["stop"] = _stop(stop)
    parsed = protocol.parse_request(inputs, max_positions, sampling_params, names)
    parsed.params.chat = use_template
    parsed.params.ignore_eos = ignore_eos
    parsed.stream = stream
    return OpenAIRequest(parsed, model_name, include_usage)
