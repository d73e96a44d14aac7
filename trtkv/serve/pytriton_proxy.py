"""trtkv's layer over PyTriton's proxy model; runs inside Triton's Python-backend stub under `trtkv serve`.

PyTriton (0.7) serves a Python function through a "proxy" Python-backend model that forwards each
request to the serving process over ZeroMQ.  Three of its gaps reached trtkv's gRPC clients (issue 38):

* a zero-element input (a `stop` tensor of shape [0]) cannot cross its data channel: serializing it
  raises in a coroutine nobody awaits, so the request was never answered (and tritonserver then
  waited for it when told to stop);
* a request it fails to forward is answered with a whole Python traceback, if at all;
* Triton's request cancellation (a gRPC client that goes away) is not passed on, so the generation
  ran on to `max_tokens`.

`TritonService` copies this file over the proxy's `model.py` before tritonserver starts (PyTriton's
own is kept next to it as `pytriton_model.py`).  Here zero-element inputs are left out (an empty
stop list means no stop strings, as over HTTP); a request that cannot be forwarded gets one error
line; every request carries a key in its parameters, and when Triton reports a request cancelled
(checked as each of its responses comes back, so within a generation step) the key is sent to the
serving process on a Unix datagram socket in PyTriton's private workspace (`CANCEL_SOCKET`), which
cancels the generation.  A request still waiting for its first token is cancelled at that token.

Only the standard library, `triton_python_backend_utils` and PyTriton's modules copied next to this
file can be imported here; nothing in trtkv imports this module.  `triton_server.py` repeats the two
constants below (tests/test_serve_protocol.py checks that they agree).
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import socket
import threading

import triton_python_backend_utils as pb_utils  # only exists inside Triton's stub

# PyTriton's proxy model.py, renamed by TritonService, in this model version's directory (package "1")
_pytriton = importlib.import_module(f"{__package__}.pytriton_model")

CANCEL_SOCKET = "trtkv-cancel.sock"
KEY_PARAMETER = "trtkv_request_key"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _last_line(exc) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _answer_error(triton_requests, message: str) -> None:
    for request in triton_requests:
        try:
            request.get_response_sender().send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                                               flags=FINAL)
        except Exception:  # already answered or gone: nothing more to tell the client
            pass


class _Keys:
    """A key per request in flight (by identity of its Triton request) and the channel that cancels it."""

    def __init__(self, workspace: str):
        self._path = os.path.join(workspace, CANCEL_SOCKET)
        self._prefix = f"{os.getpid()}-"
        self._counter = itertools.count()
        self._keys: dict[int, str] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def new(self, triton_request) -> str:
        key = f"{self._prefix}{next(self._counter)}"
        with self._lock:
            self._keys[id(triton_request)] = key
        return key

    def get(self, triton_request) -> str | None:
        with self._lock:
            return self._keys.get(id(triton_request))

    def drop(self, triton_request) -> None:
        with self._lock:
            self._keys.pop(id(triton_request), None)

    def cancel(self, key: str) -> None:
        try:
            self._sock.sendto(key.encode("ascii"), self._path)
        except OSError:  # the serving process is gone or stopping: nothing left to cancel
            pass


class _RequestsServer(_pytriton.TritonRequestsServer):
    keys: _Keys
    requests_map: dict

    def _wrap_request(self, triton_request, inputs, span=None):
        request = super()._wrap_request(triton_request, inputs, span)
        # PyTriton's data channel cannot carry a zero-element tensor; the only input that can have one
        # is `stop` (dims [-1]), where no strings means none.
        request.data = {name: value for name, value in request.data.items() if value.size}
        request.parameters = {**(request.parameters or {}), KEY_PARAMETER: self.keys.new(triton_request)}
        return request

    def push(self, requests_id, triton_requests, spans=None):
        future = super().push(requests_id, triton_requests, spans)
        future.add_done_callback(lambda f: self._forwarded(f, requests_id, triton_requests))
        return future

    def _forwarded(self, future, requests_id, triton_requests) -> None:
        """PyTriton never looks at this future: a request it failed to forward would wait forever."""
        if future.cancelled() or future.exception() is None:
            return
        self.requests_map.pop(requests_id, None)
        for request in triton_requests:
            self.keys.drop(request)
        _answer_error(triton_requests, f"trtkv could not pass the request on: {_last_line(future.exception())}")


class _CancelWatch:
    """The responses queue of one request, checking Triton's cancellation as each response arrives."""

    def __init__(self, queue, triton_requests, keys: _Keys):
        self._queue, self._requests, self._keys = queue, triton_requests, keys
        self._told = False

    async def get(self):
        item = await self._queue.get()
        if not self._told:
            try:
                cancelled = any(request.is_cancelled() for request in self._requests)
            except Exception:  # a backend without is_cancelled: forward as PyTriton does
                cancelled, self._told = False, True
            if cancelled:
                self._told = True
                for request in self._requests:
                    key = self._keys.get(request)
                    if key is not None:
                        self._keys.cancel(key)
        return item

    def task_done(self) -> None:
        self._queue.task_done()


class _ResponsesHandler(_pytriton.DecoupledResponsesHandler):
    keys: _Keys

    async def handle_responses(self, scope, responses_queue, responses_future):
        requests_id = scope["requests_id"]
        triton_requests = self._requests_map.get(requests_id, [])
        try:
            return await super().handle_responses(scope, _CancelWatch(responses_queue, triton_requests, self.keys),
                                                  responses_future)
        finally:
            self._requests_map.pop(requests_id, None)
            for request in triton_requests:
                self.keys.drop(request)


class TritonPythonModel(_pytriton.TritonPythonModel):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        keys = _Keys(config["parameters"]["workspace-path"]["string_value"])
        _RequestsServer.keys = _ResponsesHandler.keys = keys
        _pytriton.TritonRequestsServer = _RequestsServer
        _pytriton.DecoupledResponsesHandler = _ResponsesHandler
        super().initialize(args)
        self._requests_server.requests_map = self._requests

    def execute(self, triton_requests):
        try:
            return super().execute(triton_requests)
        except pb_utils.TritonModelException as e:  # PyTriton's message is the whole traceback
            for requests_id, requests in list(self._requests.items()):
                if requests is triton_requests:
                    self._requests.pop(requests_id, None)
            _answer_error(triton_requests, f"trtkv could not pass the request on: {_last_line(e)}")
            return None
