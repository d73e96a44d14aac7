"""The wire contract of trtkv's Triton model, shared by every way of serving it.

PyTriton (`triton_server.py`) and the deployed Python-backend model
(`triton_model.py`) must accept exactly the same tensors and answer with the
same outputs, so the table of inputs/outputs, the request validation and the
event-to-response mapping live here once.  Everything is plain numpy so it can
run inside Triton's Python stub, which has no PyTriton.

Validation happens here, before the engine sees a request, because an
exception escaping an inference callable reaches the client as a Python
traceback; a `RequestError` is rendered as its one-line message instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from trtkv.errors import TrtkvError

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16  # the same bounds for every way in (gRPC, KServe JSON, OpenAI JSON)
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class IO:
    """One tensor of the model signature, in Triton's own dtype names."""

    name: str
    dtype: str  # Triton datatype without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = False


INPUTS = (
    IO("text_input", "STRING"),
    IO("max_tokens", "INT32", optional=True),
    IO("temperature", "FP32", optional=True),
    IO("top_p", "FP32", optional=True),
    IO("top_k", "INT32", optional=True),
    IO("repetition_penalty", "FP32", optional=True),
    IO("seed", "INT64", optional=True),
    IO("stop", "STRING", (-1,), optional=True),
    IO("stream", "BOOL", optional=True),
    IO("ignore_eos", "BOOL", optional=True),  # exact-length generations for load tests
)

# Stats come only on the final response of a request (streamed or not);
# intermediate streamed responses carry text_output and generated_tokens.
OUTPUTS = (
    IO("text_output", "STRING"),
    IO("finish_reason", "STRING"),
    IO("prompt_tokens", "INT32"),
    IO("generated_tokens", "INT32"),
    IO("kv_bytes", "INT64"),
    IO("kv_bytes_full", "INT64"),
)

NUMPY_DTYPES = {
    "STRING": np.object_, "INT32": np.int32, "INT64": np.int64,
    "FP32": np.float32, "BOOL": np.bool_,
}


class RequestError(Exception):
    """A bad request: its message is all the client should see.

    PyTriton formats errors with `traceback.format_exception`, which reads
    `__traceback__` and prefixes the class's module; reporting no traceback
    and posing as a builtin turns the error into one line,
    "RequestError: <message>", instead of a stack dump.
    """

    __module__ = "builtins"

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, when there is one (OpenAI's error "param")

    @property
    def __traceback__(self):  # type: ignore[override]
        return None

    @__traceback__.setter
    def __traceback__(self, _value):
        pass


class InternalError(RequestError):
    """An engine failure that is not the client's fault (trace in the server log)."""

    __module__ = "builtins"


@dataclass
class ParsedRequest:
    prompt: str
    params: Any  # trtkv.api.SamplingParams
    stream: bool


def _scalar(inputs: Mapping[str, np.ndarray], key: str, kind: type, default,
            names: Mapping[str, str] | None = None):
    value = inputs.get(key)
    name = (names or {}).get(key, key)
    if value is None:
        return default
    arr = np.asarray(value)
    if arr.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got {arr.size}", name)
    item = arr.reshape(-1)[0]
    if kind is float:
        if not np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(arr.dtype, np.integer):
            raise RequestError(f"{name} must be a number, got {arr.dtype}", name)
        item = float(item)
        if not math.isfinite(item):
            raise RequestError(f"{name} must be finite, got {item}", name)
        return item
    if kind is int:
        if not np.issubdtype(arr.dtype, np.integer):
            raise RequestError(f"{name} must be an integer, got {arr.dtype}", name)
        return int(item)
    if kind is bool:
        if arr.dtype != np.bool_:
            raise RequestError(f"{name} must be a boolean, got {arr.dtype}", name)
        return bool(item)
    raise AssertionError(kind)


def check_encodable(name: str, text: str) -> str:
    """`text` if it can be encoded as UTF-8; a lone surrogate (JSON's "\\ud800") is a RequestError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name} holds a lone surrogate ({text[e.start]!a} at character {e.start}); "
                           "strings must be valid Unicode", name) from None
    return text


def _text(raw: Any, name: str) -> str:
    if isinstance(raw, str):
        return check_encodable(name, raw)
    if isinstance(raw, (bytes, np.bytes_)):
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not valid UTF-8", name) from None
    raise RequestError(f"{name} must be BYTES (a string), got {type(raw).__name__}", name)


def stop_strings(raw: Any, name: str = "stop") -> tuple[str, ...]:
    """The stop strings of a request (empty ones dropped), bounded in number and length."""
    items = np.asarray(raw, dtype=object).reshape(-1)
    if items.size > MAX_STOP_STRINGS:
        raise RequestError(f"{name} holds {items.size} strings; at most {MAX_STOP_STRINGS}", name)
    out = tuple(_text(x, name) for x in items)
    if any(len(s) > MAX_STOP_CHARS for s in out):
        raise RequestError(f"{name} strings must be at most {MAX_STOP_CHARS} characters", name)
    return tuple(s for s in out if s)


def parse_request(inputs: Mapping[str, np.ndarray], max_positions: int,
                  sampling_params: type, names: Mapping[str, str] | None = None) -> ParsedRequest:
    """Turn one request's input tensors into (prompt, SamplingParams, stream).

    `sampling_params` is passed in (normally `trtkv.api.SamplingParams`) so the
    contract can be exercised without importing the engine.  `names` maps input
    names to the field names the client used (OpenAI's `prompt` for `text_input`),
    so an error names what the client sent.
    """
    names = names or {}
    prompt_name = names.get("text_input", "text_input")
    raw = inputs.get("text_input")
    if raw is None:
        raise RequestError(f"missing required input {prompt_name}", prompt_name)
    raw = np.asarray(raw)
    if raw.size != 1:
        raise RequestError(f"{prompt_name} must hold exactly one prompt, got {raw.size}", prompt_name)
    prompt = _text(raw.reshape(-1)[0], prompt_name)
    if not prompt.strip():
        raise RequestError(f"{prompt_name} is empty", prompt_name)

    def scalar(key, kind, default):
        return _scalar(inputs, key, kind, default, names)

    max_tokens = scalar("max_tokens", int, min(DEFAULT_MAX_TOKENS, max_positions))
    if not 1 <= max_tokens <= max_positions:
        name = names.get("max_tokens", "max_tokens")
        raise RequestError(f"{name} must be between 1 and {max_positions} (the model's positions), got {max_tokens}",
                           name)
    temperature = scalar("temperature", float, 0.0)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = scalar("top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = scalar("top_k", int, 0)
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}", "top_k")
    repetition_penalty = scalar("repetition_penalty", float, 1.0)
    seed = scalar("seed", int, None)
    stream = scalar("stream", bool, False)
    extra = {"ignore_eos": True} if scalar("ignore_eos", bool, False) else {}
    stop_raw = inputs.get("stop")
    stop = () if stop_raw is None else stop_strings(stop_raw)

    params = sampling_params(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, **extra)
    try:
        params.validate(max_positions)
    except TrtkvError as e:
        raise RequestError(str(e)) from None
    return ParsedRequest(prompt, params, stream)


def _out(name: str, value) -> np.ndarray:
    if isinstance(value, str):
        return np.array([value.encode("utf-8")], dtype=np.object_)
    return np.array([value], dtype=NUMPY_DTYPES[{o.name: o.dtype for o in OUTPUTS}[name]])


def delta_outputs(text: str) -> dict[str, np.ndarray]:
    """A streamed response's text delta (HTTP front end; the Triton models add generated_tokens)."""
    return {"text_output": _out("text_output", text)}


def final_outputs(text: str, result) -> dict[str, np.ndarray]:
    """Outputs of a request's last response: text plus the engine's stats."""
    stats = getattr(result, "stats", None) or {}
    return {
        "text_output": _out("text_output", text),
        "finish_reason": _out("finish_reason", str(getattr(result, "finish_reason", "") or "")),
        "prompt_tokens": _out("prompt_tokens", int(stats.get("prompt_tokens", 0))),
        "generated_tokens": _out("generated_tokens", int(stats.get("generated_tokens",
                                                                  len(result.token_ids)))),
        "kv_bytes": _out("kv_bytes", int(stats.get("kv_bytes", 0))),
        "kv_bytes_full": _out("kv_bytes_full", int(stats.get("kv_bytes_full", 0))),
    }


def responses(events: Iterable, stream: bool) -> Iterator[dict[str, np.ndarray]]:
    """Map an engine's StreamEvents to response tensors.

    Streaming answers one response per non-empty text delta (the last one with
    stats); otherwise a single response with the whole text.
    """
    generated = 0
    for ev in events:
        generated += len(ev.token_ids or ())
        if getattr(ev, "error", None):  # the engine failed this request (e.g. out of KV memory)
            raise TrtkvError(ev.error)
        if ev.finished:
            result = ev.result
            yield final_outputs(ev.text if stream else result.text, result)
            return
        if stream and ev.text:
            yield {"text_output": _out("text_output", ev.text),
                   "generated_tokens": _out("generated_tokens", generated)}
    raise RuntimeError("engine stream ended without a final event")
