"""trtkv's HTTP front end: OpenAI `/v1/*` and KServe v2 generate, on Starlette + uvicorn.

`trtkv serve` puts this, not tritonserver's HTTP server, on the public HTTP port, because
tritonserver's JSON parser can be crashed (deep nesting) or stalled (quadratic field counts) by a
single body and neither can be configured.  Here every body is bounded (`bounded_json`, in a small
thread pool so a 4 MiB body never holds up the event loop that streams everyone else's tokens) and
checked field by field (`json_requests`) before it reaches `engine.submit`; request heads are
bounded (64 KiB); a client that goes away has its generation cancelled at once (its pages return
within a scheduler step); shutdown sends every open stream a final error event before the socket
closes.  Every error is a JSON object: OpenAI's `{"error": {"message", "type", "param", "code"}}`
under `/v1`, KServe's `{"error": message}` elsewhere, 404 and 405 included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from trtkv.errors import TrtkvError
from trtkv.serve import protocol
from trtkv.serve.bounded_json import BodyError, JsonLimits, parse_body
from trtkv.serve.json_requests import kserve_inputs, openai_request
from trtkv.serve.protocol import RequestError

LOG = logging.getLogger(__name__)
SHUTDOWN_MESSAGE = "server shutting down; the request was cancelled"
MAX_HEAD_BYTES = 64 << 10  # request line + headers (docs/serving.md, Hardening)
BODY_CHECK_THREADS = 2  # bodies are checked off the event loop; this bounds their CPU and memory at once


class _JSON(JSONResponse):
    """JSON with every non-ASCII character escaped: valid whatever a message echoes (a lone surrogate too)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


_OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 431: "invalid_request_error", 499: "invalid_request_error"}


def error_response(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """The error body of the API `path` belongs to: OpenAI's error object under /v1, KServe's elsewhere."""
    if path == "/v1" or path.startswith("/v1/"):
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    else:
        body = {"error": message}
    return _JSON(body, status_code=status, headers=headers)


class _Guard:
    """ASGI wrapper: bounds the request head and the number of requests in the app, with JSON errors.

    uvicorn's h11 parser only bounds a head that arrives in pieces (`h11_max_incomplete_event_size`);
    one that arrives whole is parsed whatever its size, so the bound is checked here too.
    """

    def __init__(self, app, max_head_bytes: int, max_active: int):
        self.app, self.max_head_bytes, self.max_active = app, max_head_bytes, max_active
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16 + sum(
            len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > self.max_head_bytes:
            response = error_response(scope["path"], 431, f"request headers are {head} bytes; "
                                      f"the limit is {self.max_head_bytes}")
        elif self.active >= self.max_active:
            response = error_response(scope["path"], 503, f"server busy: {self.active} requests open; retry later")
        else:
            self.active += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.active -= 1
            return
        await response(scope, receive, send)


class _Closing(Exception):
    """The front end is shutting down: the request ends with an error event."""


class _EngineFailed(Exception):
    """The engine failed the request with an error event (message is the engine's)."""


class _SSE(StreamingResponse):
    """A stream that always watches for the client going away and always closes its generator.

    Starlette only listens for `http.disconnect` on ASGI < 2.4 and otherwise notices a gone client
    at the next write; a generation waiting for its next token must be cancelled sooner, and its
    `finally` (which cancels the engine request) must run at once, not when the GC finds it.
    """

    media_type = "text/event-stream"

    def __init__(self, content, on_close=None):
        super().__init__(content)
        self._on_close = on_close  # runs even if the generator never started (client gone at once)

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await self.stream_response(send)

        async def disconnect() -> None:
            await self.listen_for_disconnect(receive)

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(disconnect())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()
            if self._on_close is not None:
                self._on_close()


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _plain(outputs: dict) -> dict[str, Any]:
    out = {}
    for k, v in outputs.items():
        item = v.reshape(-1)[0]
        out[k] = item.decode("utf-8", "replace") if isinstance(item, bytes) else item.item()
    return out


class HttpFrontEnd:
    """The ASGI app plus the uvicorn server running it in a daemon thread; the caller owns the engine."""

    def __init__(self, engine, sampling_params, *, host: str = "127.0.0.1", port: int = 8000,
                 model_name: str = "trtkv", limits: JsonLimits = JsonLimits(), max_inflight: int = 256):
        self.engine, self.host, self.port, self.model_name = engine, host, port, model_name
        self._sampling_params, self._limits, self._max_inflight = sampling_params, limits, max_inflight
        info = getattr(engine, "info", None) or {}
        self._max_positions = int(info.get("max_position_embeddings") or 2**31 - 1)
        self._active: set[asyncio.Queue] = set()
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = self._thread = None
        self._checks: ThreadPoolExecutor | None = None
        self.created = int(time.time())
        self.starlette = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2/models/{model}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{model}/generate", self.generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", self.generate_stream, methods=["POST"]),
        ], exception_handlers={HTTPException: self._http_error, Exception: self._server_error})
        self.app = _Guard(self.starlette, MAX_HEAD_BYTES, max_inflight + 64)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own 404 (no such route) and 405 (wrong method), as the API's error object."""
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(request.url.path, exc.status_code, message[:300], headers=exc.headers)

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        LOG.error("request %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}")

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "HttpFrontEnd":
        import uvicorn

        sock = bind_port(self.host, self.port, "--http-port")
        self.port = sock.getsockname()[1]
        # http="h11": the head bound below is h11's (httptools, if installed, would have none); requests
        # past max_inflight + 64 get a JSON 503 from _Guard, connections past limit_concurrency uvicorn's own.
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False, http="h11",
                                timeout_graceful_shutdown=5, limit_concurrency=self._max_inflight + 1024,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES, timeout_keep_alive=30)
        self._checks = ThreadPoolExecutor(BODY_CHECK_THREADS, thread_name_prefix="trtkv-body")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True, name="trtkv-http")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TrtkvError(f"the HTTP front end did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._server.serve(sockets=[sock]))
        finally:
            loop.close()
            sock.close()

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every open generation with a final error event."""
        if self._loop is None or self._closing:
            return
        self._closing = True

        def close_all():
            for q in list(self._active):
                q.put_nowait(("closing", None))

        try:
            self._loop.call_soon_threadsafe(close_all)
        except RuntimeError:  # loop already closed
            pass

    @property
    def inflight(self) -> int:
        return len(self._active)

    def stop(self, drain_s: float = 5.0) -> None:
        if self._server is None:
            return
        self.begin_shutdown()
        deadline = time.monotonic() + drain_s
        while self._active and time.monotonic() < deadline:  # let the error events go out
            time.sleep(0.05)
        self._server.should_exit = True
        self._thread.join(timeout=drain_s + 10)
        self._server = None
        if self._checks is not None:
            self._checks.shutdown(wait=False, cancel_futures=True)

    # ---- engine bridge -------------------------------------------------------------------------
    async def _submit(self, parsed: protocol.ParsedRequest):
        """Hand a request to the engine; what the engine refuses at once is the client's 400."""
        if self._closing:
            raise _Closing()
        try:
            return await asyncio.to_thread(self.engine.submit, parsed.prompt, parsed.params)
        except TrtkvError as e:
            raise RequestError(str(e)) from None

    async def _events(self, handle) -> AsyncIterator:
        """The engine's StreamEvents for one request; cancels it when the consumer stops early."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        self._active.add(queue)

        def pump():
            for ev in handle:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, ("event", ev))
                except RuntimeError:  # loop gone: nobody is listening any more
                    handle.cancel()

        threading.Thread(target=pump, daemon=True, name="trtkv-http-request").start()
        try:
            if self._closing:
                raise _Closing()
            while True:
                kind, ev = await queue.get()
                if kind == "closing":
                    raise _Closing()
                if getattr(ev, "error", None):
                    raise _EngineFailed(ev.error)
                yield ev
                if ev.finished:
                    return
        finally:
            self._active.discard(queue)
            handle.cancel()  # no-op for a finished request; frees a running or waiting one

    async def _until_done_or_gone(self, request: Request, work):
        """Run a non-streamed generation, cancelling it if the client disconnects first."""
        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
            return task.result()
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _body(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._limits.max_bytes:
            raise BodyError(f"request body is {declared} bytes; the limit is {self._limits.max_bytes}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._limits.max_bytes:
                raise BodyError(f"request body exceeds the limit of {self._limits.max_bytes} bytes", 413)
            chunks.append(chunk)
        # Off the event loop: the check is linear, but 4 MiB still costs tens of ms that every open
        # stream would wait for; the pool's few threads bound what concurrent bodies cost at once.
        return await asyncio.get_running_loop().run_in_executor(self._checks, parse_body, b"".join(chunks),
                                                                self._limits)

    # ---- KServe v2 -----------------------------------------------------------------------------
    def _kserve_error(self, status: int, message: str) -> JSONResponse:
        return _JSON({"error": message}, status_code=status)

    async def _kserve_parse(self, request: Request) -> protocol.ParsedRequest:
        model = request.path_params["model"]
        if model != self.model_name:
            raise BodyError(f"unknown model {model!r}"[:120] + f"; this server serves {self.model_name!r}", 404)
        if self._closing:
            raise BodyError(SHUTDOWN_MESSAGE, 503)
        if len(self._active) >= self._max_inflight:
            raise BodyError(f"server busy: {len(self._active)} requests in flight; retry later", 503)
        body = await self._body(request)
        return protocol.parse_request(kserve_inputs(body), self._max_positions, self._sampling_params)

    def _envelope(self, outputs: dict) -> dict[str, Any]:
        return {"model_name": self.model_name, "model_version": "1", **_plain(outputs)}

    async def generate(self, request: Request) -> Response:
        try:
            parsed = await self._kserve_parse(request)
            if parsed.stream:
                raise RequestError("generate answers once; send stream=true requests to generate_stream")

            handle = await self._submit(parsed)

            async def work():
                async for ev in self._events(handle):
                    if ev.finished:
                        return self._envelope(protocol.final_outputs(ev.result.text, ev.result))

            out = await self._until_done_or_gone(request, work())
            if out is None:
                handle.cancel()
                return self._kserve_error(499, "client disconnected")
            return _JSON(out)
        except BodyError as e:
            return self._kserve_error(e.status, str(e))
        except RequestError as e:
            return self._kserve_error(400, str(e))
        except _Closing:
            return self._kserve_error(503, SHUTDOWN_MESSAGE)
        except _EngineFailed as e:
            return self._kserve_error(500 if str(e).startswith("internal error") else 400, str(e))

    async def generate_stream(self, request: Request) -> Response:
        try:
            parsed = await self._kserve_parse(request)
            handle = await self._submit(parsed)
        except BodyError as e:
            return self._kserve_error(e.status, str(e))
        except RequestError as e:
            return self._kserve_error(400, str(e))
        except _Closing:
            return self._kserve_error(503, SHUTDOWN_MESSAGE)

        async def events():
            try:
                async for ev in self._events(handle):
                    if ev.finished:
                        yield _sse(self._envelope(protocol.final_outputs(ev.text if parsed.stream else ev.result.text,
                                                                         ev.result)))
                    elif parsed.stream and ev.text:
                        yield _sse(self._envelope(protocol.delta_outputs(ev.text)))
            except (RequestError, _EngineFailed) as e:
                yield _sse({"error": str(e)})
            except _Closing:
                yield _sse({"error": SHUTDOWN_MESSAGE})

        return _SSE(events(), on_close=handle.cancel)

    # ---- health ----------------------------------------------------------------------------------
    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=503 if self._closing else 200)

    async def model_ready(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            return Response(status_code=404)
        return Response(status_code=503 if self._closing else 200)

    # ---- OpenAI ----------------------------------------------------------------------------------
    def _openai_error(self, status: int, message: str, param: str | None = None,
                      code: str | None = None) -> JSONResponse:
        return error_response("/v1", status, message, param=param, code=code)

    def _request_error(self, e: RequestError) -> JSONResponse:
        param = getattr(e, "param", None)
        if "is not served here" in str(e):
            return self._openai_error(404, str(e), param, "model_not_found")
        return self._openai_error(400, str(e), param)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "trtkv"}

    async def models(self, request: Request) -> Response:
        return _JSON({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_name:
            return self._openai_error(404, f"The model {name!r}"[:150] + f" does not exist; this server serves "
                                      f"{self.model_name!r}", "model", "model_not_found")
        return _JSON(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, chat=True)

    async def _openai(self, request: Request, chat: bool) -> Response:
        try:
            if self._closing:
                raise BodyError(SHUTDOWN_MESSAGE, 503)
            if len(self._active) >= self._max_inflight:
                raise BodyError(f"server busy: {len(self._active)} requests in flight; retry later", 503)
            body = await self._body(request)
            req = openai_request(body, chat=chat, model_name=self.model_name, max_positions=self._max_positions,
                                 sampling_params=self._sampling_params,
                                 tokenizer=getattr(self.engine, "tokenizer", None))
            handle = await self._submit(req.parsed)
        except BodyError as e:
            return self._openai_error(e.status, str(e))
        except RequestError as e:
            return self._request_error(e)
        except _Closing:
            return self._openai_error(503, SHUTDOWN_MESSAGE)
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        base = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if req.parsed.stream:
            return _SSE(self._openai_stream(handle, req, base, chat), on_close=handle.cancel)

        async def work():
            async for ev in self._events(handle):
                if ev.finished:
                    return ev.result

        try:
            result = await self._until_done_or_gone(request, work())
        except RequestError as e:
            return self._request_error(e)
        except _Closing:
            return self._openai_error(503, SHUTDOWN_MESSAGE)
        except _EngineFailed as e:
            return self._openai_error(500 if str(e).startswith("internal error") else 400, str(e))
        if result is None:
            handle.cancel()
            return self._openai_error(499, "client disconnected")
        choice = {"index": 0, "finish_reason": _finish(result.finish_reason), "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text})
        return _JSON({**base, "choices": [choice], "usage": _usage(result)})

    async def _openai_stream(self, handle, req, base: dict, chat: bool):
        base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant", "content": ""} if first else
                         {"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {**base, "choices": [choice]}

        try:
            if chat:
                yield _sse(chunk(None, None, first=True))
            async for ev in self._events(handle):
                if ev.text or not ev.finished:
                    if ev.text:
                        yield _sse(chunk(ev.text, None))
                if ev.finished:
                    yield _sse(chunk(None, _finish(ev.result.finish_reason)))
                    if req.include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(ev.result)})
            yield _sse(b"[DONE]")
        except (RequestError, _EngineFailed) as e:
            internal = str(e).startswith("internal error")
            yield _sse({"error": {"message": str(e), "type": "server_error" if internal else "invalid_request_error",
                                  "param": None, "code": None}})
        except _Closing:
            yield _sse({"error": {"message": SHUTDOWN_MESSAGE, "type": "server_error", "param": None, "code": None}})


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(result) -> dict[str, int]:
    stats = getattr(result, "stats", None) or {}
    prompt = int(stats.get("prompt_tokens", 0))
    done = int(stats.get("generated_tokens", len(result.token_ids)))
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def bind_port(host: str, port: int, option: str) -> socket.socket:
    """A listening socket on host:port, or one clear TrtkvError naming the option to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise TrtkvError(f"cannot listen on {host}:{port} ({e.strerror}); "
                         f"another server is using it? choose a free port with {option}") from None
    sock.set_inheritable(False)
    return sock


def check_port_free(host: str, port: int, option: str) -> None:
    """Fail early, before tritonserver starts, if a port is taken (its own error is a 60-line trace)."""
    bind_port(host, port, option).close()


def distinct_ports(ports) -> None:
    """Refuse, before anything starts, two listeners given the same port ((port, option) pairs; 0 = any)."""
    seen: dict[int, str] = {}
    for port, option in ports:
        if not port:
            continue
        if port in seen:
            raise TrtkvError(f"{seen[port]} and {option} are both {port}; give each its own port")
        seen[port] = option
