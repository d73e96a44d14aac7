"""Small clients for a trtkv model served by Triton.

The model is decoupled (it streams), and Triton's HTTP `/infer` refuses
decoupled models, so there are two ways in:

* gRPC streaming with `tritonclient.grpc` (`grpc_generate`), which also gives
  the typed stats tensors;
* Triton's generate extension over plain HTTP/JSON (`http_generate`,
  `http_generate_stream`), which needs nothing beyond the standard library.

Each yields/returns dicts keyed by the model's output names; a server-side
error is raised as `ServerError` with Triton's message.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from typing import Iterator

import numpy as np

from trtkv.serve.protocol import INPUTS, NUMPY_DTYPES, OUTPUTS


class ServerError(RuntimeError):
    """The server answered a request with an error."""


def _request_fields(prompt, max_tokens, stream, **params) -> dict:
    fields = {"text_input": prompt, "max_tokens": max_tokens, "stream": stream}
    # an empty stop list means "no stop strings", so it is not sent (a zero-element tensor is answered
    # alike since issue 38; PyTriton 0.7's own proxy never answered one)
    fields.update({k: v for k, v in params.items() if v is not None and not (k == "stop" and not v)})
    known = {io.name for io in INPUTS}
    unknown = set(fields) - known
    if unknown:
        raise TypeError(f"unknown request fields {sorted(unknown)}; known: {sorted(known)}")
    return {k: v for k, v in fields.items() if v is not None}


# ---- gRPC (tritonclient) -------------------------------------------------

def grpc_inputs(fields: dict):
    """tritonclient.grpc InferInputs for the model's input table."""
    import tritonclient.grpc as grpcclient

    types = {io.name: io.dtype for io in INPUTS}
    out = []
    for name, value in fields.items():
        dtype = types[name]
        values = value if isinstance(value, (list, tuple)) else [value]
        if dtype == "STRING":
            arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values],
                           dtype=np.object_)
        else:
            arr = np.array(values, dtype=NUMPY_DTYPES[dtype])
        tensor = grpcclient.InferInput(name, list(arr.shape), "BYTES" if dtype == "STRING" else dtype)
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _decode(result) -> dict:
    out = {}
    for io in OUTPUTS:
        arr = result.as_numpy(io.name)
        if arr is not None:
            v = arr.reshape(-1)[0]
            out[io.name] = v.decode("utf-8", "replace") if isinstance(v, bytes) else v.item()
    return out


def grpc_generate(url: str, prompt: str, *, model: str = "trtkv", max_tokens: int | None = None,
                  stream: bool = True, timeout_s: float = 600.0, **params) -> Iterator[dict]:
    """Stream one generation over gRPC; yields one dict per response."""
    fields = _request_fields(prompt, max_tokens, stream, **params)
    yield from grpc_stream(url, model, grpc_inputs(fields), timeout_s)


def grpc_stream(url: str, model: str, inputs: list, timeout_s: float = 600.0) -> Iterator[dict]:
    """Send prebuilt InferInputs on a gRPC stream; yields decoded responses."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    done = False
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while not done:
            try:
                result, error = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no response within {timeout_s}s") from None
            if error is not None:
                done = True
                msg = error.message() if isinstance(error, InferenceServerException) else str(error)
                raise ServerError(msg.strip())
            done = result.get_response().parameters["triton_final_response"].bool_param
            decoded = _decode(result)
            if decoded:
                yield decoded
    finally:
        # Cancel only an abandoned generation: cancelling a stream whose request
        # Triton already rejected leaves the model busy at shutdown (seen with
        # the tritonserver in nvidia-pytriton 0.7.0).
        client.stop_stream(cancel_requests=not done)
        client.close()


# ---- HTTP/JSON (generate extension) -------------------------------------

def _post(url: str, path: str, body: dict, timeout_s: float):
    base = url if url.startswith("http") else f"http://{url}"
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", "replace").strip()
        body = body[5:] if body.startswith("data:") else body  # generate_stream errors are SSE
        try:
            msg = json.loads(body).get("error", str(e))
        except ValueError:
            msg = f"{e}: {body}"
        raise ServerError(msg.strip()) from None


def _clean(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in ("model_name", "model_version")}


def http_generate(url: str, prompt: str, *, model: str = "trtkv", max_tokens: int | None = None,
                  timeout_s: float = 600.0, **params) -> dict:
    """One non-streamed generation via `POST /v2/models/<model>/generate`."""
    body = _request_fields(prompt, max_tokens, False, **params)
    with _post(url, f"/v2/models/{model}/generate", body, timeout_s) as resp:
        return _clean(json.loads(resp.read()))


def http_generate_stream(url: str, prompt: str, *, model: str = "trtkv", max_tokens: int | None = None,
                         timeout_s: float = 600.0, **params) -> Iterator[dict]:
    """Server-sent events from `POST /v2/models/<model>/generate_stream`."""
    body = _request_fields(prompt, max_tokens, True, **params)
    with _post(url, f"/v2/models/{model}/generate_stream", body, timeout_s) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise ServerError(str(event["error"]).strip())
            yield _clean(event)


def collect(events) -> dict:
    """Join streamed responses into one: concatenated text, last stats."""
    out: dict = {"text_output": ""}
    for ev in events:
        text = ev.pop("text_output", "")
        out.update(ev)
        out["text_output"] += text
    return out
