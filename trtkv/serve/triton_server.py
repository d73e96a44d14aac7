"""Serve a trtkv engine with Triton Inference Server through PyTriton.

The engine owns batching: its background scheduler merges every request
submitted with `engine.submit`, so Triton must hand requests over as soon as
they arrive instead of batching or serialising them.  The model is therefore
decoupled with Triton batching off (Triton's `execute` returns at once), and
the PyTriton callable is an *async* generator: PyTriton runs all requests of
a model on one asyncio loop, where a blocking generator would serve them one
at a time.  Each request's blocking engine stream is pumped by its own thread
into an asyncio queue.

PyTriton's proxy model (the Python-backend side, inside tritonserver's stub) is
wrapped by `pytriton_proxy.py`, copied into PyTriton's model store before
tritonserver starts: it answers requests PyTriton would lose (a zero-element
`stop`) and passes Triton's request cancellation back here, on a Unix datagram
socket in PyTriton's private workspace (`_CancelListener`).
"""

from __future__ import annotations

import asyncio
import collections
import faulthandler
import logging
import os
import shutil
import signal
import socket
import sysconfig
import threading
import time
from pathlib import Path

from trtkv.runtime.long_lived import frozen_gc
from trtkv.serve import processes, protocol, shm
from trtkv.serve.metrics import MetricsServer, render

LOG = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "trtkv"
# Shared with pytriton_proxy.py, which runs inside tritonserver's stub and cannot import trtkv.
CANCEL_SOCKET = "trtkv-cancel.sock"
KEY_PARAMETER = "trtkv_request_key"
WARM_UP_PROMPT = "Hello"


def warm_up(engine, sampling_params) -> float:
    """One two-token generation, so that the first request is served at once: the CPU kernels are loaded,
    the KV pools allocated and every first-call cost paid before the server says it is ready.  Run before
    the engine's background loop starts (serve and the deployed model do), it is not counted in
    `requests_total`.  Returns its seconds."""
    t0 = time.monotonic()
    engine.generate(WARM_UP_PROMPT, sampling_params(max_tokens=2))
    return time.monotonic() - t0


class _OneLineErrors(logging.Filter):
    """PyTriton logs every exception raised by the inference callable with its whole traceback, and a bad
    request is one (`RequestError`); the log keeps its last line, the one the client gets.  (An engine
    failure is logged with its trace by `make_infer_fn` itself.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        if (isinstance(record.msg, str) and record.msg.startswith("Exception while performing inference")
                and isinstance(record.args, tuple) and len(record.args) == 2):
            lines = [line for line in str(record.args[1]).splitlines() if line.strip()]
            record.msg, record.args = "request %s answered with an error: %s", (record.args[0],
                                                                                  lines[-1] if lines else "")
        return True


def _install_log_filter() -> None:
    logger = logging.getLogger("pytriton.proxy.inference")
    if not any(isinstance(f, _OneLineErrors) for f in logger.filters):
        logger.addFilter(_OneLineErrors())


class _CancelListener:
    """Keys of requests Triton cancelled, sent by `pytriton_proxy.py` from the stub; cancels their generation."""

    EARLY_KEPT = 4096  # keys cancelled before their request reached the inference callable

    def __init__(self, path: Path):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.settimeout(0.5)
        self._lock = threading.Lock()
        self._waiting: dict[str, object] = {}
        self._early: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="trtkv-grpc-cancel")
        self._thread.start()

    def register(self, key: str, cancel) -> None:
        with self._lock:
            early = self._early.pop(key, 0) is None
            if not early:
                self._waiting[key] = cancel
        if early:
            cancel()

    def unregister(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                key = self._sock.recv(256).decode("ascii", "replace")
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                cancel = self._waiting.pop(key, None)
                if cancel is None:
                    self._early[key] = None
                    while len(self._early) > self.EARLY_KEPT:
                        self._early.popitem(last=False)
            if cancel is not None:
                cancel()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self.path.unlink(missing_ok=True)


def ensure_libpython_on_path() -> None:
    """Make Triton's Python stub load *this* interpreter's libpython.

    The stub bundled with PyTriton links `libpython3.X.so` by soname; without
    our LIBDIR first it can pick a system Python of the same minor version,
    whose stdlib and ABI details differ from the venv's.  tritonserver
    inherits this process's environment.
    """
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in current.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir


def _tensors(ios):
    from pytriton.model_config import Tensor

    dtype = {**protocol.NUMPY_DTYPES, "STRING": bytes}
    return [Tensor(name=io.name, dtype=dtype[io.dtype], shape=io.dims, optional=io.optional)
            for io in ios]


def _max_positions(engine) -> int:
    info = getattr(engine, "info", None) or {}
    return int(info.get("max_position_embeddings") or 2**31 - 1)


def make_infer_fn(engine, sampling_params, cancels: _CancelListener | None = None):
    """The PyTriton callable: validate, submit, stream events back; a request Triton cancels stops at once."""
    max_positions = _max_positions(engine)

    async def infer(requests):
        if len(requests) != 1:  # cannot happen with batching off; refuse rather than mix streams
            raise protocol.RequestError(f"expected one request per call, got {len(requests)}")
        parsed = protocol.parse_request(requests[0].data, max_positions, sampling_params)
        key = (getattr(requests[0], "parameters", None) or {}).get(KEY_PARAMETER)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        abandoned = threading.Event()
        handles: list = []

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # loop closed: the server is stopping
                abandoned.set()

        def cancel():  # Triton cancelled the request (the gRPC client went away): from the listener's thread
            abandoned.set()
            for handle in list(handles):
                handle.cancel()  # the engine frees its pages at its next step
            put(("cancelled", None))

        def pump():
            try:
                handle = engine.submit(parsed.prompt, parsed.params)
                handles.append(handle)
                if abandoned.is_set():
                    handle.cancel()
                    return
                for out in protocol.responses(handle, parsed.stream):
                    if abandoned.is_set():
                        handle.cancel()
                        return
                    put(("out", out))
                put(("end", None))
            except protocol.TrtkvError as e:
                put(("err", protocol.RequestError(str(e))))
            except Exception as e:  # engine bug: full trace in the server log only
                LOG.exception("generation failed")
                put(("err", protocol.InternalError(f"{type(e).__name__}: {e}")))

        if cancels is not None and key:
            cancels.register(key, cancel)
        threading.Thread(target=pump, daemon=True, name="trtkv-request").start()
        try:
            while True:
                kind, value = await queue.get()
                if kind == "out":
                    yield [value]
                elif kind == "err":
                    raise value
                else:  # end, or cancelled: the client is gone, nobody reads an error
                    return
        finally:
            abandoned.set()
            for handle in handles:
                handle.cancel()  # a no-op for a finished request
            if cancels is not None and key:
                cancels.unregister(key)

    return infer


def _triton_class():
    """PyTriton's Triton, minus its log-level check: that reads the logging API, which trtkv closes."""
    from pytriton.triton import Triton

    class _NoLogCheck:
        def check(self, skip_update: bool = False) -> None:
            pass

    class TrtkvTriton(Triton):
        def _initialize_server(self) -> None:
            super()._initialize_server()
            self._log_level_checker = _NoLogCheck()

    return TrtkvTriton


PROXY_FOR_PYTRITON = "0.7."  # the PyTriton release whose proxy model pytriton_proxy.py extends


def install_proxy(model_dir: Path) -> bool:
    """Put `pytriton_proxy.py` over the proxy model PyTriton wrote to `<store>/<model>/<version>/model.py`.

    Only over the PyTriton release it was written against (it extends that proxy's internals); with
    another, PyTriton's own proxy stays and the log says what that costs."""
    import pytriton

    if not pytriton.__version__.startswith(PROXY_FOR_PYTRITON):
        LOG.warning("nvidia-pytriton %s is not %sx: gRPC cancellation and zero-element stop tensors are left to "
                    "PyTriton's own proxy (see docs/serving.md)", pytriton.__version__, PROXY_FOR_PYTRITON)
        return False
    if not (model_dir / "pytriton_model.py").exists():
        (model_dir / "model.py").rename(model_dir / "pytriton_model.py")
    shutil.copyfile(Path(__file__).with_name("pytriton_proxy.py"), model_dir / "model.py")
    return True


class TritonService:
    """A running PyTriton server plus trtkv's HTTP front end for one engine; a context manager.

    tritonserver serves gRPC only (its HTTP JSON parser can be crashed by one request, see
    `http_front.py`); the public HTTP port is trtkv's front end (OpenAI `/v1/*`, KServe v2
    generate/generate_stream, health).  The caller keeps ownership of the engine (it is started,
    not shut down).
    """

    def __init__(self, engine, sampling_params, *, host="127.0.0.1", http_port=8000,
                 grpc_port=8001, metrics_port=8002, trtkv_metrics_port=None,
                 model_name=DEFAULT_MODEL_NAME, log_verbose=0, open_apis=(), limits=None):
        self.engine, self.model_name, self.host = engine, model_name, host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.trtkv_metrics_port = metrics_port + 1 if trtkv_metrics_port is None else trtkv_metrics_port
        self._sampling_params, self._log_verbose = sampling_params, log_verbose
        self._open_apis, self._limits = tuple(open_apis), limits
        self._triton = self._metrics = self.front = self._cancels = None
        self._triton_procs: dict[int, str] = {}

    def start(self) -> "TritonService":
        from pytriton.model_config import ModelConfig
        from pytriton.triton import TritonConfig, TritonLifecyclePolicy, TritonSecurityConfig

        from trtkv.serve.bounded_json import JsonLimits
        from trtkv.serve.http_front import HttpFrontEnd, check_port_free, distinct_ports
        from trtkv.serve.restrictions import grpc_restriction

        ports = ((self.http_port, "--http-port"), (self.grpc_port, "--grpc-port"),
                 (self.metrics_port, "--metrics-port"), (self.trtkv_metrics_port, "--trtkv-metrics-port"))
        distinct_ports(ports)
        for port, option in ports:
            if port:  # 0: pick a free one
                check_port_free(self.host, port, option)
        ensure_libpython_on_path()
        _install_log_filter()
        LOG.info("engine warmed up in %.1f s", warm_up(self.engine, self._sampling_params))  # before anything is ready
        self.engine.start_background()
        config = TritonConfig(allow_http=False, grpc_address=self.host, grpc_port=self.grpc_port,
                              metrics_address=self.host, metrics_port=self.metrics_port,
                              log_verbose=self._log_verbose, exit_timeout_secs=15,
                              grpc_restricted_protocol=grpc_restriction(self._open_apis, pytriton=True))
        # The model is written to PyTriton's model store before tritonserver starts and loaded by it
        # at startup, so PyTriton never needs the model-repository API, and no access token (which
        # tritonserver would only take on its world-readable command line) exists.
        self._triton = _triton_class()(
            config=config, triton_lifecycle_policy=TritonLifecyclePolicy(launch_triton_on_startup=True,
                                                                         local_model_store=True),
            security_config=TritonSecurityConfig(restricted_endpoints=[]))
        try:
            workspace = Path(self._triton._workspace.path)
            self._cancels = _CancelListener(workspace / CANCEL_SOCKET)
            self._triton.bind(model_name=self.model_name,
                              infer_func=make_infer_fn(self.engine, self._sampling_params, self._cancels),
                              inputs=_tensors(protocol.INPUTS), outputs=_tensors(protocol.OUTPUTS),
                              config=ModelConfig(batching=False, decoupled=True))
            install_proxy(Path(self._triton._workspace.model_store_path) / self.model_name / "1")
            started = threading.Event()
            guard = threading.Thread(target=self._guard_shm, args=(started,), daemon=True, name="trtkv-shm")
            guard.start()  # the stub creates its region before the model is ready to take a prompt
            try:
                self._triton.run()
            finally:
                started.set()
                guard.join()
            self._triton_procs = self._note_tritonserver()
            labels = {"model": self.model_name}
            self._metrics = MetricsServer(self.host, self.trtkv_metrics_port,
                                          lambda: render(self.engine.metrics(), labels)).start()
            self.trtkv_metrics_port = self._metrics.port
            self.front = HttpFrontEnd(self.engine, self._sampling_params, host=self.host,
                                      port=self.http_port, model_name=self.model_name,
                                      limits=self._limits or JsonLimits()).start()
            self.http_port = self.front.port
        except BaseException:
            self.stop()
            raise
        return self

    def _guard_shm(self, started: threading.Event) -> None:
        while True:
            shm.make_private(self.shm_prefix)
            if started.wait(0.05):
                shm.make_private(self.shm_prefix)
                return

    def _note_tritonserver(self) -> dict[int, str]:
        """This service's tritonserver (its command line holds our unique shm prefix) and its stubs."""
        prefix, mine = self.shm_prefix, {}
        for pid, cmd in processes.descendants(os.getpid()).items():
            if "tritonserver" in cmd and prefix in cmd:
                mine[pid] = cmd
                mine.update(processes.descendants(pid))
        return mine

    def alive(self) -> bool:
        return self._triton is not None and self._triton.is_alive()

    @property
    def shm_prefix(self) -> str:
        """The Python backend's region names: PyTriton's own prefix (pid + random) when readable."""
        backend = getattr(self._triton, "_python_backend_config", None)
        try:
            return str(backend["shm-region-prefix-name"])
        except (TypeError, KeyError):
            return f"pytrtion{os.getpid()}-"

    def wait(self) -> str | None:
        """Block until Triton dies, the engine stops for good (a tensor-parallel rank was lost; returns why) or
        SIGINT/SIGTERM arrives."""
        from trtkv.distributed.launch import lost_rank

        while self.alive():
            if self.engine.failure is not None:
                return self.engine.failure
            lost = lost_rank()  # a rank that died while the server was idle (no collective to notice it)
            if lost is not None:
                return f"tensor-parallel {lost}"
            shm.make_private(self.shm_prefix)
            threading.Event().wait(0.5)
        return None

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()  # open streams get a final error event first
            self.front = None
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
        if self._triton is not None:
            prefix = self.shm_prefix
            self._triton.stop()
            self._triton = None
            leftovers = processes.kill_leftovers(self._triton_procs)
            if leftovers:
                LOG.warning("killed processes tritonserver left behind: %s", leftovers)
            shm.remove(prefix)  # left behind when tritonserver crashed
        if self._cancels is not None:
            self._cancels.close()
            self._cancels = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(engine_path, host="127.0.0.1", http_port=8000, grpc_port=8001, metrics_port=8002,
          model_name=None, trtkv_metrics_port=None, log_verbose=0, open_apis=(), tp=None, runtime="torch") -> int:
    """Load an engine (under ``runtime``, ``Engine.load``'s) and serve it until SIGINT/SIGTERM; returns the exit
    status.

    0 after a requested shutdown; 1 when tritonserver died under the service or a tensor-parallel rank was lost
    (the log says why). With ``tp`` ranks (default: the engine's ``--tp``) rank 0 serves and the others follow
    its engine loop (``Engine.follow``).
    """
    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    from trtkv.artifacts.engine_dir import engine_tp
    from trtkv.distributed.group import RankInfo
    from trtkv.serve.http_front import check_port_free, distinct_ports
    from trtkv.serve.restrictions import closed

    closed(open_apis, pytriton=True)  # an unknown category is refused before anything loads
    env = RankInfo.from_env()
    if env is not None and env.rank != 0:  # a rank that rank 0 (or torchrun) started
        follower_tp = engine_tp(tp, [engine_path])
        if follower_tp > 1:
            return _follow(engine_path, follower_tp)
    ports = ((http_port, "--http-port"), (grpc_port, "--grpc-port"), (metrics_port, "--metrics-port"),
             (metrics_port + 1, "--trtkv-metrics-port (default: --metrics-port + 1)") if trtkv_metrics_port is None
             else (trtkv_metrics_port, "--trtkv-metrics-port"))
    distinct_ports(ports)
    for port, option in ports:
        check_port_free(host, port, option)  # before the engine loads: a clash costs a second, not a minute
    from trtkv.api import Engine, SamplingParams  # torch: after the checks, which take a second at most

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        # also SIGINT: a server started in the background by a non-interactive shell inherits SIGINT ignored, and
        # Python then installs no handler of its own (measured: `trtkv serve ... &` from a script never stopped)
        signal.signal(signal.SIGINT, _interrupt)
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    from trtkv.distributed.launch import join_ranks

    tp = engine_tp(tp, [engine_path])  # (after the port checks: a clash is one line before the engine is read)
    join_ranks(tp)
    engine = Engine.load(engine_path, tp=tp, runtime=runtime)
    status = 0
    try:
        with frozen_gc(), TritonService(engine, SamplingParams, host=host, http_port=http_port,
                                        grpc_port=grpc_port, metrics_port=metrics_port,
                                        trtkv_metrics_port=trtkv_metrics_port,
                                        model_name=model_name or DEFAULT_MODEL_NAME,
                                        log_verbose=log_verbose, open_apis=open_apis) as service:
            LOG.info("serving %s as model %r: http (OpenAI + KServe generate) %s:%d grpc %s:%d "
                     "metrics :%d trtkv metrics :%d", engine_path, service.model_name, host,
                     service.http_port, host, grpc_port, metrics_port, service.trtkv_metrics_port)
            try:
                failure = service.wait()
                LOG.error("%s; shutting down", failure or "tritonserver exited unexpectedly")
                status = 1
            except KeyboardInterrupt:
                LOG.info("interrupted, shutting down")
    finally:
        engine.shutdown()
    return status


def _follow(engine_path, tp: int) -> int:
    """A tensor-parallel rank other than 0 of ``trtkv serve``: run rank 0's engine loop until it stops."""
    from trtkv.api import Engine, SamplingParams
    from trtkv.distributed.group import RankLost
    from trtkv.distributed.launch import join_ranks

    join_ranks(tp)
    engine = Engine.load(engine_path, tp=tp)
    try:
        warm_up(engine, SamplingParams)  # rank 0 warms up the same way before its loop starts
        engine.follow()
    except RankLost as e:
        LOG.error("%s", e)
        return 1
    return 0
