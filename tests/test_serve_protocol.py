"""The serving wire contract without a server: validation, event mapping, error text."""

from __future__ import annotations

import asyncio
import traceback
from types import SimpleNamespace

import numpy as np
import pytest

from trtkv.errors import TrtkvError
from trtkv.runtime.sampling import SamplingParams
from trtkv.serve import protocol
from trtkv.serve.protocol import RequestError, parse_request



def req(**fields):
    out = {"text_input": np.array([b"hello"], dtype=np.object_)}
    for k, v in fields.items():
        out[k] = v if isinstance(v, np.ndarray) else np.array([v])
    return out


def test_defaults_and_fields():
    p = parse_request(req(), 100, SamplingParams)
    assert (p.prompt, p.stream, p.params.max_tokens, p.params.temperature) == ("hello", False, 100, 0.0)
    p = parse_request(req(max_tokens=np.array([7], np.int32), temperature=np.array([0.5], np.float32),
                          top_k=np.array([3], np.int32), seed=np.array([9], np.int64),
                          repetition_penalty=np.array([1.2], np.float32),
                          stream=np.array([True]), ignore_eos=np.array([True]),
                          stop=np.array([b"a", b"", b"bc"], dtype=np.object_)), 4096, SamplingParams)
    assert p.stream and p.params.ignore_eos
    assert (p.params.max_tokens, p.params.top_k, p.params.seed, p.params.stop) == (7, 3, 9, ("a", "bc"))
    assert p.params.repetition_penalty == pytest.approx(1.2)


@pytest.mark.parametrize("fields,message", [
    ({"text_input": None}, "missing required input text_input"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one prompt"),
    ({"text_input": np.array([b" \n"], dtype=np.object_)}, "text_input is empty"),
    ({"text_input": np.array([b"\xc3\x28"], dtype=np.object_)}, "not valid UTF-8"),
    ({"max_tokens": np.array([0], np.int32)}, "max_tokens must be between 1 and 64"),
    ({"max_tokens": np.array([65], np.int32)}, "max_tokens must be between 1 and 64"),
    ({"max_tokens": np.array([1.5], np.float32)}, "max_tokens must be an integer"),
    ({"temperature": np.array([np.nan], np.float32)}, "temperature must be finite"),
    ({"top_p": np.array([1.5], np.float32)}, "top_p must be in (0, 1]"),
    ({"top_k": np.array([-1], np.int32)}, "top_k must be >= 0"),
    ({"stream": np.array([1], np.int32)}, "stream must be a boolean"),
    ({"seed": np.array([-1], np.int64)}, "seed must be a non-negative integer"),
    ({"repetition_penalty": np.array([-2.0], np.float32)}, "repetition_penalty must be in (0, 10]"),
])
def test_bad_fields(fields, message):
    inputs = req()
    for k, v in fields.items():
        if v is None:
            inputs.pop(k)
        else:
            inputs[k] = v
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        parse_request(inputs, 64, SamplingParams)


def test_request_error_formats_as_one_line():
    try:
        try:
            raise KeyError("context that must not leak")
        except KeyError:
            raise RequestError("max_tokens must be > 0") from None
    except RequestError as e:
        text = "".join(traceback.format_exception(None, e, e.__traceback__))
    assert text == "RequestError: max_tokens must be > 0\n"


def ev(text, ids, finished=False, result=None, error=None):
    return SimpleNamespace(text=text, token_ids=ids, finished=finished, result=result, error=error)


RESULT = SimpleNamespace(text="a b", token_ids=[1, 2], finish_reason="length",
                         stats={"prompt_tokens": 3, "generated_tokens": 2, "kv_bytes": 10, "kv_bytes_full": 20})


def test_responses_stream_and_final():
    events = [ev("a", [1]), ev("", []), ev(" b", [2], True, RESULT)]
    streamed = list(protocol.responses(events, stream=True))
    assert [r["text_output"][0] for r in streamed] == [b"a", b" b"]
    assert streamed[0]["generated_tokens"][0] == 1 and "kv_bytes" not in streamed[0]
    assert streamed[-1]["kv_bytes"].dtype == np.int64 and streamed[-1]["finish_reason"][0] == b"length"
    (once,) = protocol.responses(events, stream=False)
    assert once["text_output"][0] == b"a b" and once["prompt_tokens"][0] == 3


def test_engine_error_event_raises():
    with pytest.raises(TrtkvError, match="out of KV"):
        list(protocol.responses([ev("a", [1]), ev("", [], True, RESULT, "out of KV memory")], True))


class TinyEngine:
    """submit() contract only: fails on demand, else one word per event."""

    info = {"max_position_embeddings": 32}

    def __init__(self, fail=None):
        self.fail = fail

    def submit(self, prompt, params):
        if self.fail == "bad":
            raise TrtkvError("the prompt has 99 tokens but the model has 32 positions; shorten it")
        if self.fail == "bug":
            raise ZeroDivisionError("oops")
        words = [" w"] * params.max_tokens
        res = SimpleNamespace(text="".join(words), token_ids=list(range(len(words))), finish_reason="length",
                              stats={"prompt_tokens": 1, "generated_tokens": len(words)})
        return Handle([ev(w, [i], i == len(words) - 1, res if i == len(words) - 1 else None)
                       for i, w in enumerate(words)])


class Handle(list):
    """A RequestHandle's contract: iterate the events, cancel."""

    cancelled = False

    def cancel(self):
        self.cancelled = True


def run_infer(engine, **fields):
    pytest.importorskip("pytriton")
    from trtkv.serve.triton_server import make_infer_fn

    infer = make_infer_fn(engine, SamplingParams)

    async def go():
        return [r async for r in infer([SimpleNamespace(data=req(**fields))])]

    return asyncio.run(go())


def test_infer_fn_streams_and_maps_errors():
    out = run_infer(TinyEngine(), max_tokens=np.array([3], np.int32), stream=np.array([True]))
    assert len(out) == 3 and out[-1][0]["generated_tokens"][0] == 3
    with pytest.raises(RequestError, match="32 positions"):
        run_infer(TinyEngine("bad"))
    with pytest.raises(protocol.InternalError, match="ZeroDivisionError: oops"):
        run_infer(TinyEngine("bug"))


# ---- issue 38: the gRPC path has the HTTP bounds, one-line errors, cancellation -----------------------

def test_stop_strings_bounded_on_every_path():
    """Tensors (gRPC, the deployed model) get the same stop limits as JSON: 16 strings of 256 characters."""
    many = np.array([b"x"] * (protocol.MAX_STOP_STRINGS + 1), dtype=np.object_)
    with pytest.raises(RequestError, match="stop holds 17 strings; at most 16"):
        parse_request(req(stop=many), 64, SamplingParams)
    with pytest.raises(RequestError, match="stop strings must be at most 256 characters"):
        parse_request(req(stop=np.array([b"x" * (1 << 20)], dtype=np.object_)), 64, SamplingParams)
    with pytest.raises(RequestError, match="stop is not valid UTF-8"):
        parse_request(req(stop=np.array(["\ud800".encode("utf-8", "surrogatepass")], dtype=np.object_)), 64,
                      SamplingParams)
    with pytest.raises(RequestError, match="stop holds a lone surrogate"):
        parse_request(req(stop=np.array(["\ud800"], dtype=np.object_)), 64, SamplingParams)
    assert parse_request(req(stop=np.array([], dtype=np.object_)), 64, SamplingParams).params.stop == ()
    ok = np.array([b"x" * 256] * 16, dtype=np.object_)
    assert len(parse_request(req(stop=ok), 64, SamplingParams).params.stop) == 16


def test_errors_name_the_clients_fields():
    names = {"text_input": "prompt", "max_tokens": "max_completion_tokens"}
    with pytest.raises(RequestError, match="^prompt is empty$") as err:
        parse_request(req(text_input=np.array([b"  "], dtype=np.object_)), 64, SamplingParams, names)
    assert err.value.param == "prompt"
    with pytest.raises(RequestError, match="^max_completion_tokens must be between 1 and 64") as err:
        parse_request(req(max_tokens=np.array([0], np.int32)), 64, SamplingParams, names)
    assert err.value.param == "max_completion_tokens"


def test_stub_proxy_shares_the_cancel_constants():
    """pytriton_proxy.py runs in tritonserver's stub and cannot import trtkv: its constants are repeated."""
    import ast
    from pathlib import Path

    pytest.importorskip("pytriton")
    from trtkv.serve import triton_server

    tree = ast.parse((Path(triton_server.__file__).parent / "pytriton_proxy.py").read_text())
    consts = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.Constant)}
    assert consts["CANCEL_SOCKET"] == triton_server.CANCEL_SOCKET
    assert consts["KEY_PARAMETER"] == triton_server.KEY_PARAMETER


def test_pytriton_traceback_logged_as_one_line():
    import logging

    pytest.importorskip("pytriton")
    from trtkv.serve.triton_server import _OneLineErrors

    trace = ('Traceback (most recent call last):\n  File "x.py", line 1, in infer\n    raise RequestError\n'
             "RequestError: max_tokens must be between 1 and 64 (the model's positions), got 0\n")
    record = logging.LogRecord("pytriton.proxy.inference", logging.WARNING, "x", 1,
                               "Exception while performing inference on requests=%s: %s", ("00000002", trace), None)
    assert _OneLineErrors().filter(record)
    assert record.getMessage() == ("request 00000002 answered with an error: RequestError: max_tokens must be "
                                   "between 1 and 64 (the model's positions), got 0")


class SlowHandle:
    """Events every 10 ms until cancelled; counts the events produced after `cancel`."""

    def __init__(self, n):
        self.n, self.cancelled, self.after_cancel = n, False, 0

    def __iter__(self):
        import time

        for i in range(self.n):
            done = i == self.n - 1 or self.cancelled
            self.after_cancel += self.cancelled
            yield ev(" w", [i], done, RESULT if done else None)
            if done:
                return
            time.sleep(0.01)

    def cancel(self):
        self.cancelled = True


def test_grpc_cancel_reaches_the_generation(tmp_path):
    """A key sent on the cancel socket (by the stub, when Triton reports the request cancelled) ends the
    callable's stream and cancels the engine request: at most one more event is produced, of 100,000."""
    import socket

    pytest.importorskip("pytriton")
    from trtkv.serve.triton_server import KEY_PARAMETER, _CancelListener, make_infer_fn

    handle = SlowHandle(100_000)
    engine = SimpleNamespace(info={"max_position_embeddings": 32}, submit=lambda prompt, params: handle)
    listener = _CancelListener(tmp_path / "cancel.sock")
    infer = make_infer_fn(engine, SamplingParams, listener)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    async def go():
        got = 0
        request = SimpleNamespace(data=req(stream=np.array([True])), parameters={KEY_PARAMETER: "7-1"})
        async for _ in infer([request]):
            got += 1
            if got == 3:
                sender.sendto(b"7-1", str(tmp_path / "cancel.sock"))
        return got

    try:
        got = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        listener.close()
        sender.close()
    assert handle.cancelled and handle.after_cancel <= 1 and got < 100
    assert not (tmp_path / "cancel.sock").exists()


def test_cancel_before_the_request_arrives_still_cancels(tmp_path):
    import socket
    import time

    pytest.importorskip("pytriton")
    from trtkv.serve.triton_server import _CancelListener

    listener = _CancelListener(tmp_path / "c.sock")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"9-9", str(tmp_path / "c.sock"))
        cancelled = []
        for _ in range(500):  # the listener thread has to take the datagram first (bounded: 5 s)
            listener.register("9-9", lambda: cancelled.append(True))
            if cancelled:
                break
            listener.unregister("9-9")
            time.sleep(0.01)
        assert cancelled
    finally:
        listener.close()
