"""Serving under abuse (issues 19 and 38): each numbered case against a real server process on 127.0.0.1.

One `python -m trtkv.serve serve` process serves the module (its SIGTERM test runs last); the
deployed repository runs under `python -m trtkv.serve tritonserver` twice (healthy, then crashed).
Tests named `test_38_*` are issue 38's cases; assertions count events and steps, never seconds (the
bounded waits are hang guards).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("pytriton")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("starlette")

from serve_helpers import (HOST, PROMPT, ROOT, children, free_ports, gauges, group_processes, http_json,  # noqa: E402
                           python_env, serve_command, stop_process, wait_gauges_idle, wait_ready)

from trtkv.serve import client  # noqa: E402
from trtkv.serve.client import ServerError  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.model]

DEEP = b'{"text_input":"hi","x":' + b"[" * 150_000 + b"]" * 150_000 + b"}"
WIDE = b'{"text_input":"hi","x":{' + b",".join(b'"k%d":1' % i for i in range(100_000)) + b"}}"


class Server:
    def __init__(self, proc, log, http, grpc, metrics, trtkv_metrics):
        self.proc, self.log = proc, log
        self.http, self.grpc, self.metrics, self.trtkv_metrics = http, grpc, metrics, trtkv_metrics

    @property
    def http_url(self):
        return f"{HOST}:{self.http}"

    def post(self, path: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
        return http_json(self.http, "POST", path, body, timeout=timeout)

    def alive(self) -> bool:
        wait_ready(self.http_url, "trtkv", 10, self.proc)
        return True


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "smollm2-135m-full"
    subprocess.run([sys.executable, "-m", "trtkv.cli", "build", "--model", "smollm2-135m",
                    "--policy", "full", "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    return out


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    http, grpc, metrics, trtkv_metrics = free_ports(4)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_command("serve", engine_dir, "--host", HOST, "--http-port", http,
                                              "--grpc-port", grpc, "--metrics-port", metrics,
                                              "--trtkv-metrics-port", trtkv_metrics),
                                cwd=ROOT, env=python_env(), stdout=out, stderr=subprocess.STDOUT)
    srv = Server(proc, log, http, grpc, metrics, trtkv_metrics)
    try:
        wait_ready(srv.http_url, "trtkv", 240, proc)
        srv.gauges_when_ready = gauges(trtkv_metrics)
        yield srv
    finally:
        stop_process(proc)


def tritonserver_pid(srv) -> int:
    (pid,) = [p for p in children(srv.proc.pid) if "tritonserver" in Path(f"/proc/{p}/cmdline").read_text()]
    return pid


# 1 and 10: one body must not kill or stall the server ------------------------------------------------

def test_1_deep_json_is_refused_and_server_survives(server):
    for path in ("/v2/models/trtkv/generate", "/v2/models/trtkv/generate_stream", "/v1/completions"):
        status, body = server.post(path, DEEP)
        assert status == 400 and "nested" in json.dumps(body), (path, status, body)
    assert server.alive()
    assert client.http_generate(server.http_url, PROMPT, max_tokens=2)["generated_tokens"] >= 1


def test_10_huge_field_count_is_refused(server):
    status, body = server.post("/v2/models/trtkv/generate", WIDE)
    assert status == 400 and "values" in body["error"]
    status, body = server.post("/v1/chat/completions", b"x" * (5 << 20))
    assert status == 413 and body["error"]["type"] == "invalid_request_error"


def test_38_ready_means_warm(server):
    """Ready only once a request can be served at once: the warm-up generation allocated the KV pools (and
    loaded the kernels) before the HTTP front end and tritonserver's model answered; it is no request."""
    g = server.gauges_when_ready
    assert g.get("trtkv_kv_pool_bytes", 0) > 0 and g["trtkv_requests_total"] == 0, g
    log = server.log.read_text(errors="replace")
    assert log.index("engine warmed up") < log.index("serving ")


def test_38_2_adversarial_body_answered_while_a_stream_flows(server):
    """4 MiB of an unterminated string of \\" pairs: the body check was quadratic (80 KB: 12 s) and ran on
    the event loop, stalling every client.  Now it is a 400, and a stream opened before it keeps going."""
    body = {"model": "trtkv", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(HOST, server.http, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
    resp = conn.getresponse()
    assert resp.status == 200
    events: list[bytes] = [resp.readline()]
    assert events[0].startswith(b"data: ")
    answer: list = []
    adversarial = (b'{"model": "trtkv", "prompt": "' + b'\\"' * (2 << 20))[: 4 << 20]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: answer.append(server.post("/v1/completions", adversarial, timeout=120)))
        for line in iter(resp.readline, b""):  # the stream runs on to its 400 tokens
            if line.startswith(b"data: "):
                events.append(line)
                if line.strip() == b"data: [DONE]":
                    break
        fut.result(timeout=180)
    conn.close()
    (status, reply), = answer
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    chunks = [json.loads(e[6:]) for e in events if e.strip() != b"data: [DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len(chunks) > 10
    assert server.alive()


# 2 and 3: no admin API, no token, private shared memory ----------------------------------------------

def test_2_3_admin_apis_closed_no_token_in_proc(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    cmdline = Path(f"/proc/{tritonserver_pid(server)}/cmdline").read_bytes().decode().split("\0")
    assert "--allow-http" in cmdline and cmdline[cmdline.index("--allow-http") + 1] == "False"
    assert not any("access-token" in a or "triton-access" in a for a in cmdline)
    rule = cmdline[cmdline.index("--grpc-restricted-protocol") + 1]
    key, value = rule.split(":", 1)[1].split("=", 1)  # what a local user reads in /proc

    c = grpcclient.InferenceServerClient(f"{HOST}:{server.grpc}")
    attempts = {
        "shared-memory": lambda h: c.register_system_shared_memory("x", "/triton_python_backend_shm_region_1",
                                                                   1024, headers=h),
        "model-repository": lambda h: c.load_model("evil", headers=h,
                                                   files={"file:1/model.py": b"import os"}),
        "repository-index": lambda h: c.get_model_repository_index(headers=h),
        "trace": lambda h: c.get_trace_settings(headers=h),
        "statistics": lambda h: c.get_inference_statistics(headers=h),
        "logging": lambda h: c.get_log_settings(headers=h),  # issue 38: open under trtkv serve before
        "logging-update": lambda h: c.update_log_settings({"log_verbose_level": 1}, headers=h),
    }
    for name, call in attempts.items():
        for headers in (None, {key: value}, {key.lower(): value}, {f"triton-grpc-protocol-{key.lower()}": value}):
            with pytest.raises(InferenceServerException):
                call(headers)
    with pytest.raises(OSError):  # tritonserver's own HTTP is off: only trtkv's front end speaks HTTP
        http.client.HTTPConnection(HOST, server.http).request("GET", "/v2/repository/index")
        raise OSError("front end answered")
    regions = list(Path("/dev/shm").glob(f"pytrtion{server.proc.pid}-*"))
    assert regions
    for r in regions:
        assert stat.S_IMODE(r.stat().st_mode) & 0o077 == 0, f"{r} readable by others"
    assert server.alive()


# 5 and 7: every malformed body is a 4xx with one line; integers do not wrap ----------------------------

BAD_KSERVE = [
    (b"", "empty"), (b"[]", "JSON object"), (b"null", "JSON object"), (b'{"text_input": "hi"', "not valid JSON"),
    (b'"hi"', "JSON object"), (b"\xff\xfe", "not valid JSON"),
    (b'{"text_input": "hi", "max_tokens": "abc"}', "max_tokens must be an integer"),
    (b'{"text_input": "hi", "max_tokens": 3.5}', "max_tokens must be an integer"),
    (b'{"text_input": "hi", "max_tokens": null}', "max_tokens is null"),
    (b'{"text_input": "hi", "max_tokens": true}', "max_tokens must be an integer"),
    (b'{"text_input": "hi", "max_tokens": 4294967298}', "must fit INT32"),
    (b'{"text_input": "hi", "max_tokens": -1}', "max_tokens must be between 1"),
    (b'{"text_input": "hi", "seed": 99999999999999999999999}', "must fit INT64"),
    (b'{"text_input": "hi", "temperature": "hot"}', "temperature must be a number"),
    (b'{"text_input": "hi", "temperature": 1e300}', "does not fit FP32"),
    (b'{"text_input": "hi", "top_p": NaN}', "top_p must be finite"),
    (b'{"text_input": "hi", "stream": "yes"}', "stream must be true or false"),
    (b'{"text_input": "hi", "stop": [1, 2]}', "stop must be a string"),
    (b'{"text_input": "hi", "stop": {"a": 1}}', "stop must be a string or an array"),
    (b'{"text_input": ["hi"]}', "text_input must be a string"),
    (b'{"text_input": 5}', "text_input must be a string"),
    (b'{"text_input": "\\ud800"}', "text_input holds a lone surrogate"),
    (b'{"text_input": "hi", "stop": ["\\ud800"]}', "stop holds a lone surrogate"),  # issue 38: was a 500
    (b'{"text_input": "hi", "stop": ["x", "\\udfff"]}', "stop holds a lone surrogate"),
    (b'{"text_input": "hi", "bogus": 1}', "unknown input 'bogus'"),
    (b'{"max_tokens": 3}', "missing required input text_input"),
]
BAD_OPENAI = [
    ("/v1/completions", {"model": "trtkv"}, "prompt must be a string"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, "not served here"),
    ("/v1/completions", {"prompt": "hi"}, "model must be a string"),
    ("/v1/completions", {"model": "trtkv", "prompt": "hi", "max_tokens": 2**32 + 2}, "must fit"),
    ("/v1/completions", {"model": "trtkv", "prompt": "hi", "n": 3}, "n=3 is not supported"),
    ("/v1/completions", {"model": "trtkv", "prompt": "hi", "frobnicate": 1}, "unknown field"),
    ("/v1/chat/completions", {"model": "trtkv", "messages": []}, "messages must be a non-empty array"),
    ("/v1/chat/completions", {"model": "trtkv", "messages": [{"role": "god", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"model": "trtkv", "messages": [{"role": "user", "content": None}]}, "content"),
    ("/v1/chat/completions", {"model": "trtkv", "messages": [{"role": "user", "content": "x"}],
                              "temperature": -1}, "temperature"),
    # issue 38: lone surrogates are a 400 (stop was a 500), and errors name OpenAI's fields
    ("/v1/completions", {"model": "trtkv", "prompt": "hi", "stop": ["\ud800"]}, "stop holds a lone surrogate"),
    ("/v1/completions", {"model": "trtkv", "prompt": "a\ud800"}, "prompt holds a lone surrogate"),
    ("/v1/chat/completions", {"model": "trtkv", "messages": [{"role": "user", "content": "x"}], "stop": "\udc00"},
     "stop holds a lone surrogate"),
    ("/v1/chat/completions", {"model": "trtkv", "messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content holds a lone surrogate"),
    ("/v1/completions", {"model": "trtkv", "prompt": "  "}, "prompt is empty"),
    ("/v1/completions", {"model": "trtkv", "prompt": "hi", "stop": ["x"] * 17}, "stop holds 17 strings"),
]


def test_7_malformed_bodies_get_4xx_never_500(server):
    for body, message in BAD_KSERVE:
        for path in ("/v2/models/trtkv/generate", "/v2/models/trtkv/generate_stream"):
            status, reply = server.post(path, body)
            assert 400 <= status < 500 and message in reply["error"], (path, body[:60], status, reply)
            assert "\n" not in reply["error"] and "Traceback" not in reply["error"]
    for path, body, message in BAD_OPENAI:
        status, reply = server.post(path, json.dumps(body).encode())
        assert 400 <= status < 500 and message in reply["error"]["message"], (path, body, status, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"} and "text_input" not in json.dumps(reply)
    status, _ = server.post("/v2/models/other/generate", b'{"text_input": "hi"}')
    assert status == 404
    assert server.alive()


def test_5_empty_stop_list_is_answered(server):
    out = client.http_generate(server.http_url, PROMPT, max_tokens=3, stop=[], timeout_s=60)
    assert out["generated_tokens"] >= 1
    status, reply = server.post("/v1/completions", json.dumps(
        {"model": "trtkv", "prompt": "The capital of France is", "max_tokens": 3, "stop": []}).encode())
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1


# OpenAI clients speak the front end ------------------------------------------------------------------

def test_openai_client_completions_chat_and_stream(server):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["trtkv"]
    done = oa.completions.create(model="trtkv", prompt="The capital of France is", max_tokens=5)
    assert done.choices[0].text and done.usage.completion_tokens == 5
    chat = oa.chat.completions.create(model="trtkv", messages=[{"role": "user", "content": PROMPT}],
                                      max_tokens=8, temperature=0)
    want = client.http_generate(server.http_url, PROMPT, max_tokens=8)
    assert chat.choices[0].message.content == want["text_output"]
    pieces = [c.choices[0].delta.content or "" for c in oa.chat.completions.create(
        model="trtkv", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, stream=True) if c.choices]
    assert "".join(pieces) == want["text_output"] and len([p for p in pieces if p]) > 1
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oa.completions.create(model="trtkv", prompt="hi", max_tokens=0)


def test_38_5_openai_compatibility(server):
    """GET /v1/models/{id}, error objects for 404/405/431, chat logprobs=false, OpenAI's field names."""
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
    assert oa.models.retrieve("trtkv").id == "trtkv"
    with pytest.raises(openai.NotFoundError) as err:
        oa.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oa.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    chat = oa.chat.completions.create(model="trtkv", messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
                                      logprobs=False)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens must be between") as err:
        oa.chat.completions.create(model="trtkv", messages=[{"role": "user", "content": "hi"}],
                                   max_completion_tokens=0)
    assert err.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        oa.completions.create(model="trtkv", prompt="", max_tokens=2)
    for method, path, status in [("GET", "/v1/embeddings", 404), ("DELETE", "/v1/models/trtkv", 405),
                                 ("GET", "/v1/chat/completions", 405)]:
        conn = http.client.HTTPConnection(HOST, server.http, timeout=30)
        conn.request(method, path)
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        conn.close()
        assert resp.status == status and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    conn = http.client.HTTPConnection(HOST, server.http, timeout=30)
    conn.request("GET", "/v1/models", headers={"X-Pad": "a" * 100_000})  # docs/serving.md: heads up to 64 KiB
    resp = conn.getresponse()
    assert resp.status == 431 and "65536" in json.loads(resp.read())["error"]["message"]
    conn.close()


# 38.3: gRPC requests are all answered, once, without a traceback in the log; cancelling stops the generation

def _grpc_input(name, array, dtype):
    import numpy as np
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, list(np.shape(array)), dtype)
    tensor.set_data_from_numpy(np.asarray(array, dtype=np.object_ if dtype == "BYTES" else None))
    return tensor


def test_38_3_every_grpc_request_answered_once_without_traceback(server):
    import numpy as np

    text = _grpc_input("text_input", [PROMPT.encode()], "BYTES")
    two = client.grpc_inputs({"max_tokens": 2})
    bad = {
        "max_tokens 0": (client.grpc_inputs({"text_input": PROMPT, "max_tokens": 0}), "max_tokens must be between"),
        "5,000 stop strings": ([text] + two + [_grpc_input("stop", [b"x"] * 5000, "BYTES")], "stop holds 5000"),
        "1 MB stop string": ([text] + two + [_grpc_input("stop", [b"x" * (1 << 20)], "BYTES")], "at most 256"),
        "surrogate stop": ([text] + two + [_grpc_input("stop", ["\ud800".encode("utf-8", "surrogatepass")],
                                                        "BYTES")], "stop is not valid UTF-8"),
        "invalid UTF-8 prompt": (client.grpc_inputs({"text_input": b"\xff\xfe", "max_tokens": 2}), "not valid UTF-8"),
        "no prompt": (two, "text_input"),
        "two prompts": ([_grpc_input("text_input", [b"a", b"b"], "BYTES")] + two, "text_input"),
        "wrong dtype": ([text, _grpc_input("max_tokens", np.array([2], np.int64), "INT64")], "expects 'INT32'"),
        "unknown input": ([text, _grpc_input("bogus", [b"x"], "BYTES")], "bogus"),
    }
    size = server.log.stat().st_size
    for name, (inputs, message) in bad.items():
        with pytest.raises(ServerError) as err:
            list(client.grpc_stream(f"{HOST}:{server.grpc}", "trtkv", inputs, timeout_s=120))
        text_ = str(err.value)
        assert message in text_ and "Traceback" not in text_ and "\n" not in text_, (name, text_)
    # a zero-element stop (shape [0]) was never answered; now it is no stop strings, as `"stop": []` over HTTP
    empty = [text] + two + [_grpc_input("stop", np.array([], dtype=np.object_), "BYTES")]
    out = client.collect(client.grpc_stream(f"{HOST}:{server.grpc}", "trtkv", empty, timeout_s=120))
    assert out["generated_tokens"] == 2 and out["finish_reason"] == "length"
    with open(server.log, "rb") as f:
        f.seek(size)
        log = f.read().decode(errors="replace")
    assert "Traceback" not in log and log.count("answered with an error") >= 5, log[-3000:]
    assert server.alive()


def test_38_3_cancelled_grpc_stream_frees_its_pages(server):
    """The gRPC client goes away mid-stream (cancels): the generation stops (it ran on to max_tokens)."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    conn = grpcclient.InferenceServerClient(f"{HOST}:{server.grpc}")
    conn.start_stream(callback=lambda result, error: results.put((result, error)))
    conn.async_stream_infer("trtkv", client.grpc_inputs({"text_input": PROMPT, "max_tokens": 8000, "ignore_eos": True,
                                                         "stream": True}), enable_empty_final_response=True)
    for _ in range(3):
        assert results.get(timeout=300)[1] is None
    assert gauges(server.trtkv_metrics)["trtkv_live_requests"] == 1
    conn.stop_stream(cancel_requests=True)
    conn.close()
    _, g = wait_gauges_idle(server.trtkv_metrics, 30)  # hang guard; 8,000 tokens would take minutes
    assert g["trtkv_live_requests"] == 0 and g["trtkv_live_pages"] == 0, g
    assert client.collect(client.grpc_generate(f"{HOST}:{server.grpc}", PROMPT, max_tokens=2))["generated_tokens"]


# 6: a client that goes away stops its generation ---------------------------------------------------

def _open_and_drop(server, path: str, body: dict, read_first: bool):
    conn = http.client.HTTPConnection(HOST, server.http, timeout=30)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if read_first:
        resp = conn.getresponse()
        assert resp.status == 200
        assert b"data: " in resp.read1(65536)  # the first event arrived: generation is running
    else:
        time.sleep(1.5)  # the request is generating
    conn.sock.close()
    conn.close()


def test_6_disconnect_cancels_generation_and_frees_pages(server):
    long = {"max_tokens": 8000, "ignore_eos": True}  # minutes of generation each: only a cancel frees them
    drops = [("/v1/completions", {"model": "trtkv", "prompt": PROMPT, "stream": True, **long}, True),
             ("/v1/chat/completions", {"model": "trtkv", "messages": [{"role": "user", "content": PROMPT}],
                                       **long}, False),
             ("/v2/models/trtkv/generate_stream", {"text_input": PROMPT, "stream": True, **long}, True),
             ("/v2/models/trtkv/generate", {"text_input": PROMPT, **long}, False)]
    with ThreadPoolExecutor(len(drops)) as pool:
        list(pool.map(lambda d: _open_and_drop(server, *d), drops))
    _, g = wait_gauges_idle(server.trtkv_metrics, 30)  # hang guard: freed within a step of each disconnect
    assert g["trtkv_live_requests"] == 0 and g["trtkv_live_pages"] == 0, g
    assert client.http_generate(server.http_url, PROMPT, max_tokens=2)["generated_tokens"] >= 1


# 9: port clashes are one clear line and never touch the other server ---------------------------------

@pytest.mark.parametrize("option", ["--http-port", "--grpc-port", "--trtkv-metrics-port"])
def test_9_port_clash_is_one_line(server, engine_dir, option):
    http, grpc, metrics, trtkv_metrics = free_ports(4)
    ports = {"--http-port": http, "--grpc-port": grpc, "--metrics-port": metrics,
             "--trtkv-metrics-port": trtkv_metrics}
    ports[option] = {"--http-port": server.http, "--grpc-port": server.grpc,
                     "--trtkv-metrics-port": server.trtkv_metrics}[option]
    args = [a for k, v in ports.items() for a in (k, v)]
    run = subprocess.run(serve_command("serve", engine_dir, "--host", HOST, *args), cwd=ROOT,
                         env=python_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trtkv: error: cannot listen on") and option in lines[0], \
        run.stderr[-2000:]
    assert server.alive()  # still serving, model still loaded
    assert client.collect(client.grpc_generate(f"{HOST}:{server.grpc}", PROMPT, max_tokens=2))["generated_tokens"]


# 8: SIGTERM mid-stream ends streams with an error event; exit status 0; nothing left behind ------------

def test_8_sigterm_mid_stream_sends_final_error_event(server):
    triton = tritonserver_pid(server)
    conn = http.client.HTTPConnection(HOST, server.http, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "trtkv", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode())
    resp = conn.getresponse()
    assert resp.status == 200 and b"data: " in resp.read1(65536)
    server.proc.send_signal(signal.SIGTERM)
    events = [ln for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
    assert "shutting down" in json.loads(events[-1][6:])["error"]["message"]
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()[-3000:]
    assert not group_processes(triton) and not children(server.proc.pid)
    assert not list(Path("/dev/shm").glob(f"pytrtion{server.proc.pid}-*"))


# the deployed repository under `python -m trtkv.serve tritonserver` --------------------------------------

@pytest.fixture(scope="module")
def repo(engine_dir, tmp_path_factory):
    from trtkv.serve.deploy import deploy

    root = tmp_path_factory.mktemp("repo")
    deploy(engine_dir, root, "trtkv")
    return root


def launch_deployed(repo, log: Path, *extra):
    http, grpc, metrics = free_ports(3)
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_command("tritonserver", repo, "--host", HOST, "--http-port", http,
                                              "--grpc-port", grpc, "--metrics-port", metrics, *extra),
                                cwd=ROOT, env=python_env(), stdout=out, stderr=subprocess.STDOUT)
    wait_ready(f"{HOST}:{http}", "trtkv", 240, proc)
    (triton,) = children(proc.pid)
    return proc, triton, http, grpc


def test_deployed_admin_apis_closed_private_shm_and_clean_sigterm(repo, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    proc, triton, http_port, grpc = launch_deployed(repo, tmp_path / "deployed.log")
    try:
        cmdline = Path(f"/proc/{triton}/cmdline").read_bytes().decode()
        assert "--model-control-mode=none" in cmdline
        for method, path, body in [("POST", "/v2/systemsharedmemory/region/x/register",
                                    b'{"key": "/triton_python_backend_shm_region_1", "offset": 0, "byte_size": 64}'),
                                   ("POST", "/v2/repository/index", b"{}"),
                                   ("POST", "/v2/repository/models/evil/load", b"{}"),
                                   ("GET", "/v2/logging", None), ("GET", "/v2/trace/setting", None)]:
            conn = http.client.HTTPConnection(HOST, http_port, timeout=10)
            conn.request(method, path, body=body, headers={"trtkv-closed": "unsendable"})
            assert conn.getresponse().status >= 400, path
            conn.close()
        c = grpcclient.InferenceServerClient(f"{HOST}:{grpc}")
        with pytest.raises(InferenceServerException):
            c.register_system_shared_memory("x", "/triton_python_backend_shm_region_1", 64)
        regions = list(Path("/dev/shm").glob(f"trtkv-{proc.pid}-*"))
        assert regions
        time.sleep(1.5)  # the launcher tightens modes twice a second
        for r in regions:
            assert stat.S_IMODE(r.stat().st_mode) & 0o077 == 0, f"{r} readable by others"
        assert client.http_generate(f"{HOST}:{http_port}", PROMPT, max_tokens=2, stop=[])["generated_tokens"] >= 1

        got: list = []

        def stream():
            try:
                for ev in client.grpc_generate(f"{HOST}:{grpc}", PROMPT, max_tokens=2000, ignore_eos=True,
                                               timeout_s=60):
                    got.append(ev)
            except ServerError as e:
                got.append(e)

        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(stream)
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            fut.result(timeout=60)
        assert isinstance(got[-1], ServerError) and "shutting down" in str(got[-1])
        assert proc.wait(timeout=60) == 0, (tmp_path / "deployed.log").read_text()[-3000:]
    finally:
        stop_process(proc)
    assert not group_processes(triton) and not list(Path("/dev/shm").glob(f"trtkv-{proc.pid}-*"))


def test_deployed_crash_is_reported_and_cleaned_up(repo, tmp_path):
    """Deep JSON still kills tritonserver's own HTTP parser (not configurable): the launcher says so."""
    proc, triton, http_port, _ = launch_deployed(repo, tmp_path / "crash.log")
    try:
        conn = http.client.HTTPConnection(HOST, http_port, timeout=30)
        try:
            conn.request("POST", "/v2/models/trtkv/generate", body=DEEP)
            conn.getresponse().read()
        except OSError:
            pass
        rc = proc.wait(timeout=60)
    finally:
        stop_process(proc)
    log = (tmp_path / "crash.log").read_text(errors="replace")
    assert rc != 0
    assert "trtkv: error: tritonserver exited unexpectedly with signal" in log, log[-2000:]
    assert not group_processes(triton), "orphaned Python-backend stub"
    assert not list(Path("/dev/shm").glob(f"trtkv-{proc.pid}-*"))


def test_1_tritonserver_crash_under_serve_is_reported(engine_dir, tmp_path):
    """If tritonserver dies under `trtkv serve`, the command says so and exits 1 (it exited 0), and
    neither its stub nor its shared memory outlives it."""
    http_port, grpc, metrics, trtkv_metrics = free_ports(4)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_command("serve", engine_dir, "--host", HOST, "--http-port", http_port,
                                              "--grpc-port", grpc, "--metrics-port", metrics,
                                              "--trtkv-metrics-port", trtkv_metrics),
                                cwd=ROOT, env=python_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"{HOST}:{http_port}", "trtkv", 240, proc)
        srv = Server(proc, log, http_port, grpc, metrics, trtkv_metrics)
        triton = tritonserver_pid(srv)
        stubs = children(triton)
        assert stubs
        os.kill(triton, signal.SIGSEGV)
        rc = proc.wait(timeout=90)
    finally:
        stop_process(proc)
    text = log.read_text(errors="replace")
    assert rc == 1 and "tritonserver exited unexpectedly" in text, text[-3000:]
    assert not group_processes(triton) and all(not Path(f"/proc/{s}").exists() or
                                               "Z" in Path(f"/proc/{s}/stat").read_text().rsplit(")", 1)[1][:3]
                                               for s in stubs)
    assert not list(Path("/dev/shm").glob(f"pytrtion{proc.pid}-*"))
