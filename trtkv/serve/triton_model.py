"""Triton Python-backend model for a trtkv engine (used by deployed repositories).

A repository written by `trtkv.serve.deploy` has a one-line `1/model.py` that
re-exports `TritonPythonModel` from here, so upgrading trtkv upgrades every
deployed model; the engine path comes from `model.json` next to
`config.pbtxt`, in the style of Triton's vLLM backend.

The model is decoupled: `execute` only validates and hands each request to
`engine.submit`, then returns, so Triton keeps feeding requests and the
engine's scheduler batches them.  One thread per request streams the engine's
events back through the request's response sender.  Runs inside Triton's
Python stub, where `triton_python_backend_utils` is importable.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # only exists inside Triton's stub

from trtkv.serve import protocol
from trtkv.serve.metrics import GAUGES
from trtkv.serve.triton_server import warm_up

LOG = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_PERIOD_S = 1.0
FINALIZE_WAIT_S = 8.0
SHUTDOWN_MESSAGE = "server shutting down; the request was cancelled"
DRAIN_ENV = "TRTKV_DRAIN_FILE"


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class _Gauges:
    """trtkv gauges on Triton's own /metrics, refreshed by a daemon thread."""

    def __init__(self, engine, labels: dict):
        self._engine, self._stop = engine, threading.Event()
        self._families, self._metrics, self._last = {}, {}, {}
        for key, (name, help_, kind) in GAUGES.items():
            fam_kind = pb_utils.MetricFamily.COUNTER if kind == "counter" else pb_utils.MetricFamily.GAUGE
            family = pb_utils.MetricFamily(name=name, description=help_, kind=fam_kind)
            self._families[key], self._metrics[key] = family, family.Metric(labels=labels)
        self._thread = threading.Thread(target=self._run, daemon=True, name="trtkv-gauges")
        self._thread.start()

    def _run(self):
        while not self._stop.wait(METRICS_PERIOD_S):
            try:
                self.update()
            except Exception:  # never let metrics take the model down
                LOG.exception("updating trtkv metrics failed")

    def update(self):
        values = self._engine.metrics()
        for key, metric in self._metrics.items():
            if key not in values:
                continue
            value = float(values[key])
            if GAUGES[key][2] == "counter":  # Triton counters only increment
                delta = value - self._last.get(key, 0.0)
                if delta > 0:
                    metric.increment(delta)
                self._last[key] = value
            else:
                metric.set(value)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self._metrics.clear()  # metrics must go before their families
        self._families.clear()


class TritonPythonModel:
    def initialize(self, args):
        model_dir = Path(args["model_repository"])
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("trtkv models must be decoupled "
                                                "(model_transaction_policy { decoupled: true })")
        spec = json.loads((model_dir / "model.json").read_text())
        api = importlib.import_module(spec.get("api", "trtkv.api"))
        self._sampling_params = api.SamplingParams
        self._engine = api.Engine.load(spec["engine"])
        # Triton calls the model ready when this returns: the first request must be served at once
        LOG.info("engine warmed up in %.1f s", warm_up(self._engine, self._sampling_params))
        self._engine.start_background()
        info = getattr(self._engine, "info", None) or {}
        self._max_positions = int(info.get("max_position_embeddings") or 2**31 - 1)
        self._gauges = _Gauges(self._engine, {"model": args["model_name"],
                                              "version": args["model_version"]})
        self._inflight: set[threading.Thread] = set()
        self._closing = threading.Event()
        drain = os.environ.get(DRAIN_ENV)
        if drain:
            threading.Thread(target=self._watch_drain, args=(Path(drain),), daemon=True,
                             name="trtkv-drain").start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            inputs = {}
            for io in protocol.INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, io.name)
                if tensor is not None:
                    inputs[io.name] = tensor.as_numpy()
            try:
                parsed = protocol.parse_request(inputs, self._max_positions, self._sampling_params)
            except protocol.RequestError as e:
                sender.send(_error(str(e)), flags=FINAL)
                continue
            if self._closing.is_set():
                sender.send(_error(SHUTDOWN_MESSAGE), flags=FINAL)
                continue
            thread = threading.Thread(target=self._stream, args=(request, sender, parsed),
                                      daemon=True, name="trtkv-request")
            self._inflight.add(thread)
            thread.start()
        return None

    def _stream(self, request, sender, parsed):
        try:
            self._respond(request, sender, parsed)
        finally:
            self._inflight.discard(threading.current_thread())

    def _respond(self, request, sender, parsed):
        handle = None
        try:
            handle = self._engine.submit(parsed.prompt, parsed.params)
            for out in protocol.responses(handle, parsed.stream):
                if self._closing.is_set():
                    handle.cancel()
                    sender.send(_error(SHUTDOWN_MESSAGE), flags=FINAL)
                    return
                if request.is_cancelled():
                    handle.cancel()
                    sender.send(_error("request cancelled"), flags=FINAL)
                    return
                tensors = [pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in out.items()]
                last = "finish_reason" in out
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                            flags=FINAL if last else 0)
        except protocol.TrtkvError as e:
            sender.send(_error(str(e)), flags=FINAL)
        except Exception as e:
            LOG.exception("generation failed")
            if handle is not None:
                handle.cancel()
            sender.send(_error(f"internal error: {type(e).__name__}: {e}"), flags=FINAL)

    def _watch_drain(self, path: Path):
        """The launcher asks for a drain (SIGTERM) by creating `path` before it stops tritonserver,
        which closes client connections before `finalize` runs: end open streams while they can
        still be answered."""
        while not self._closing.wait(0.1):
            if path.exists():
                self._closing.set()

    def finalize(self):
        """End open streams with an error response before the engine goes (else the stub's response
        senders outlive the model and tritonserver crashes on the way out)."""
        self._closing.set()
        deadline = time.monotonic() + FINALIZE_WAIT_S
        for thread in list(self._inflight):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._gauges.close()
        self._engine.shutdown()
