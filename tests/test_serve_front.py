"""trtkv's HTTP front end in-process, on a fake engine (no model, no tritonserver; issue 38).

The body check runs off the event loop (a stream keeps receiving events while a 4 MiB body is checked),
every error under /v1 is an OpenAI error object (404 and 405 too), `/v1/models/{id}`, request heads
bounded at 64 KiB as docs/serving.md says, and duplicate ports refused at once.  Every loop is bounded;
assertions count events and statuses, never seconds.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_helpers import HOST, ROOT, free_ports, http_json, python_env  # noqa: E402

from trtkv.runtime.sampling import SamplingParams  # noqa: E402
from trtkv.serve import http_front  # noqa: E402
from trtkv.serve.http_front import HttpFrontEnd  # noqa: E402

ADVERSARIAL = (b'{"text_input": "' + b'\\"' * (2 << 20))[: 4 << 20]  # an unterminated string of \" pairs


class FakeHandle:
    """One word per event every `delay` seconds until max_tokens or cancel (then a final event)."""

    def __init__(self, max_tokens: int, delay: float):
        self.max_tokens, self.delay, self.cancelled = max_tokens, delay, False

    def __iter__(self):
        for i in range(self.max_tokens):
            last = i == self.max_tokens - 1 or self.cancelled
            result = SimpleNamespace(text=" w" * (i + 1), token_ids=list(range(i + 1)),
                                     finish_reason="cancelled" if self.cancelled else "length",
                                     stats={"prompt_tokens": 1, "generated_tokens": i + 1}) if last else None
            yield SimpleNamespace(text=" w", token_ids=[i], finished=last, result=result, error=None)
            if last:
                return
            time.sleep(self.delay)

    def cancel(self):
        self.cancelled = True


class FakeEngine:
    info = {"max_position_embeddings": 1 << 20}
    tokenizer = SimpleNamespace(has_chat_template=False)

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    def submit(self, prompt, params):
        return FakeHandle(params.max_tokens, self.delay)


@pytest.fixture
def front():
    fe = HttpFrontEnd(FakeEngine(delay=0.002), SamplingParams, host=HOST, port=0, model_name="trtkv").start()
    try:
        yield fe
    finally:
        fe.stop(drain_s=1)


def request(fe, method: str, path: str, body: bytes | None = None, headers=None) -> tuple[int, dict]:
    return http_json(fe.port, method, path, body, headers)


def assert_openai_error(status_body, status: int, message: str) -> dict:
    status_got, body = status_body
    assert status_got == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert message in body["error"]["message"], body
    return body["error"]


def test_body_check_runs_off_the_event_loop(front, monkeypatch):
    """While the check of a 4 MiB adversarial body runs, the event loop keeps streaming another request's
    events: the check waits (in its worker thread) until the loop has sent 3 more events, which it cannot
    do if the check holds the loop (the wait then gives up after 30 s and the test fails)."""
    sent = [0]
    real_sse, real_parse = http_front._sse, http_front.parse_body

    def counting_sse(obj):
        sent[0] += 1
        return real_sse(obj)

    seen = []

    def parse_after_progress(body, limits):
        if len(body) == len(ADVERSARIAL):
            start = sent[0]
            for _ in range(3000):  # at most 30 s
                if sent[0] >= start + 3:
                    break
                time.sleep(0.01)
            seen.append(sent[0] - start)
            if seen[-1] < 3:  # the loop was held: do not also run the (old, quadratic) check on it
                raise http_front.BodyError("the event loop made no progress during the body check")
        return real_parse(body, limits)

    monkeypatch.setattr(http_front, "_sse", counting_sse)
    monkeypatch.setattr(http_front, "parse_body", parse_after_progress)
    stream = http.client.HTTPConnection(HOST, front.port, timeout=60)
    stream.request("POST", "/v2/models/trtkv/generate_stream",
                   body=json.dumps({"text_input": "hi", "max_tokens": 100_000, "stream": True}).encode())
    resp = stream.getresponse()
    assert resp.status == 200 and b"data: " in resp.read1(65536)
    def drain():  # keep reading until the test closes the connection
        try:
            resp.read()
        except (OSError, AttributeError, http.client.HTTPException):
            pass

    threading.Thread(target=drain, daemon=True).start()
    try:
        status, body = request(front, "POST", "/v2/models/trtkv/generate", ADVERSARIAL)
    finally:
        stream.sock.close()
        stream.close()
    assert seen and seen[0] >= 3, f"the stream sent {seen} events while the body was checked"
    assert status == 400 and "not valid JSON" in body["error"]


def test_openai_errors_everywhere_under_v1(front):
    openai = pytest.importorskip("openai")
    assert_openai_error(request(front, "GET", "/v1/nope"), 404, "no such endpoint: GET /v1/nope")
    assert_openai_error(request(front, "POST", "/v1/models", b"{}"), 405, "POST is not allowed")
    assert_openai_error(request(front, "GET", "/v1/completions"), 405, "GET is not allowed")
    assert_openai_error(request(front, "POST", "/v1/completions", b"[1"), 400, "not valid JSON")
    assert_openai_error(request(front, "POST", "/v1/completions", b"x" * (5 << 20)), 413, "limit")
    err = assert_openai_error(request(front, "POST", "/v1/completions", b'{"model": "trtkv", "prompt": ""}'),
                              400, "prompt is empty")
    assert err["param"] == "prompt" and err["type"] == "invalid_request_error"
    assert_openai_error(request(front, "POST", "/v1/chat/completions", json.dumps(
        {"model": "trtkv", "messages": [{"role": "user", "content": " "}]}).encode()), 400, "messages hold no text")
    err = assert_openai_error(request(front, "POST", "/v1/chat/completions", json.dumps(
        {"model": "trtkv", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}).encode()),
        400, "max_completion_tokens must be between 1")
    assert err["param"] == "max_completion_tokens"
    err = assert_openai_error(request(front, "POST", "/v1/completions", b'{"model": "gpt-4", "prompt": "hi"}'),
                              404, "is not served here")
    assert err["code"] == "model_not_found"
    status, body = request(front, "GET", "/v2/nope")  # KServe's shape outside /v1
    assert status == 404 and body == {"error": "no such endpoint: GET /v2/nope"}

    oa = openai.OpenAI(base_url=f"http://{HOST}:{front.port}/v1", api_key="unused", max_retries=0)
    card = oa.models.retrieve("trtkv")
    assert (card.id, card.object, card.owned_by) == ("trtkv", "model", "trtkv")
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and "does not exist" in e.value.body["message"]
    chat = oa.chat.completions.create(model="trtkv", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                      logprobs=False, n=1, presence_penalty=0)
    assert chat.choices[0].message.content == " w w w"
    with pytest.raises(openai.BadRequestError, match="logprobs=True is not supported"):
        oa.chat.completions.create(model="trtkv", messages=[{"role": "user", "content": "hi"}], logprobs=True)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v2/models/trtkv/generate",
                                  "/v2/models/trtkv/generate_stream"])
def test_lone_surrogates_are_a_400_on_every_endpoint(front, path):
    chat = path.endswith("chat/completions")
    prompt_field = ({"messages": [{"role": "user", "content": "hi"}]} if chat else
                    {"prompt": "hi"} if path.startswith("/v1") else {"text_input": "hi"})
    model = {"model": "trtkv"} if path.startswith("/v1") else {}
    bodies = [json.dumps({**model, **prompt_field, "stop": ["ok", "\ud800"]}),
              json.dumps({**model, **prompt_field, "stop": "\udfff"})]
    if chat:
        bodies.append(json.dumps({**model, "messages": [{"role": "user", "content": "a\ud800b"}]}))
    elif path.startswith("/v1"):
        bodies.append(json.dumps({**model, "prompt": "a\ud800b"}))
    else:
        bodies.append(json.dumps({"text_input": "a\ud800b"}))
    for body in bodies:
        status, reply = request(front, "POST", path, body.encode())
        message = reply["error"]["message"] if path.startswith("/v1") else reply["error"]
        assert status == 400 and "lone surrogate" in message and "\n" not in message, (body, status, reply)
        assert "text_input" not in message or not path.startswith("/v1")
    status, _ = request(front, "POST", path, json.dumps({**model, **prompt_field, "max_tokens": 2}).encode())
    assert status == 200


def test_request_head_bounded_at_64_kib(front):
    """docs/serving.md: request headers are limited to 64 KiB (h11 alone let a 100 KB head through)."""
    status, body = request(front, "GET", "/v1/models", headers={"X-Pad": "a" * 60_000})
    assert status == 200 and body["data"][0]["id"] == "trtkv"
    assert_openai_error(request(front, "GET", "/v1/models", headers={"X-Pad": "a" * 100_000}), 431,
                        "the limit is 65536")
    status, body = request(front, "GET", "/v2/health/live", headers={"X-Pad": "a" * 100_000})
    assert status == 431 and "the limit is 65536" in body["error"]
    try:  # a head that arrives in pieces is cut off by h11 itself: a plain 400, or a reset while still sending
        status, _ = request(front, "GET", "/v1/models", headers={f"X-Pad-{i}": "a" * 8000 for i in range(40)})
    except ConnectionError:
        status = 400
    assert status in (400, 431)
    status, _ = request(front, "GET", "/v1/models")
    assert status == 200


DUPLICATE_PORTS = [
    ("serve", ["--http-port", "{a}", "--grpc-port", "{a}"], "--http-port and --grpc-port are both {a}"),
    ("serve", ["--http-port", "{a}", "--metrics-port", "{a}"], "--http-port and --metrics-port are both {a}"),
    ("serve", ["--grpc-port", "{a}", "--metrics-port", "{b}", "--trtkv-metrics-port", "{a}"],
     "--grpc-port and --trtkv-metrics-port are both {a}"),
    ("tritonserver", ["--http-port", "{a}", "--grpc-port", "{a}"], "--http-port and --grpc-port are both {a}"),
    ("tritonserver", ["--grpc-port", "{a}", "--metrics-port", "{a}"], "--grpc-port and --metrics-port are both {a}"),
]


@pytest.mark.parametrize("command,flags,message", DUPLICATE_PORTS)
def test_duplicate_ports_refused_at_once(tmp_path, command, flags, message):
    """One `trtkv: error:` line and exit 2, before anything loads (it took 24 s and 92 log lines)."""
    a, b = free_ports(2)
    flags = [f.format(a=a, b=b) for f in flags]
    run = subprocess.run([sys.executable, "-m", "trtkv.cli", command, str(tmp_path), "--host", HOST, *flags],
                         cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
    assert run.returncode == 2 and lines == [f"trtkv: error: {message.format(a=a)}; give each its own port"], lines
