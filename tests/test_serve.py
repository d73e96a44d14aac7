"""Triton serving end to end on a real engine (smollm2-135m, full KV policy).

Everything listens on 127.0.0.1 with free ports; every server a test starts
is stopped in a `finally`, and every request loop is bounded.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("pytriton")
pytest.importorskip("tritonclient.grpc")

from trtkv.serve import client  # noqa: E402
from trtkv.serve.client import ServerError  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.model]

from serve_helpers import (HOST, PROMPT, ROOT, free_ports, scrape_until, stop_process, wait_idle,  # noqa: E402
                           wait_ready)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "smollm2-135m-full"
    subprocess.run([sys.executable, "-m", "trtkv.cli", "build", "--model", "smollm2-135m",
                    "--policy", "full", "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    return out


@pytest.fixture(scope="module")
def engine(engine_dir):
    from trtkv.api import Engine

    eng = Engine.load(engine_dir)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def service(engine):
    from trtkv.api import SamplingParams
    from trtkv.serve.triton_server import TritonService

    gc.collect()  # engines earlier tests dropped still reserve pool address space, and starting Triton forks
    http, grpc, metrics, trtkv_metrics = free_ports(4)
    svc = TritonService(engine, SamplingParams, host=HOST, http_port=http, grpc_port=grpc,
                        metrics_port=metrics, trtkv_metrics_port=trtkv_metrics)
    try:
        svc.start()
        svc.metrics_when_ready = engine.metrics()
        yield svc
    finally:
        svc.stop()


def urls(svc):
    return f"{HOST}:{svc.http_port}", f"{HOST}:{svc.grpc_port}"


def expected(engine, prompt=PROMPT, **kw):
    from trtkv.api import SamplingParams

    return engine.generate(prompt, SamplingParams(**kw))[0]


def test_grpc_stream_equals_engine_generate(service, engine):
    _, grpc = urls(service)
    want = expected(engine, max_tokens=24)
    events = list(client.grpc_generate(grpc, PROMPT, max_tokens=24))
    got = client.collect([dict(e) for e in events])
    assert len(events) > 1  # really streamed
    assert got["text_output"] == want.text
    assert got["generated_tokens"] == len(want.token_ids)
    assert got["finish_reason"] == want.finish_reason
    assert got["prompt_tokens"] == want.stats["prompt_tokens"]
    assert got["kv_bytes"] > 0


def test_http_generate_and_stream_equal_engine_generate(service, engine):
    http, _ = urls(service)
    want = expected(engine, max_tokens=16)
    one = client.http_generate(http, PROMPT, max_tokens=16)
    assert one["text_output"] == want.text and one["generated_tokens"] == len(want.token_ids)
    streamed = client.collect(client.http_generate_stream(http, PROMPT, max_tokens=16))
    assert streamed["text_output"] == want.text
    grpc_once = list(client.grpc_generate(urls(service)[1], PROMPT, max_tokens=16, stream=False))
    assert len(grpc_once) == 1 and grpc_once[0]["text_output"] == want.text


def test_ready_means_warm(service):
    """start() returns (and the front end answers ready) only after a warm-up generation: the KV pools are
    allocated and the kernels loaded before the first request; the warm-up is not counted as a request."""
    m = service.metrics_when_ready
    assert m["kv_pool_bytes"] > 0 and m["requests_total"] == 0 and m["live_requests"] == 0


def _stream(grpc, i, n):
    return client.collect(client.grpc_generate(grpc, f"{PROMPT} (request {i})", max_tokens=n, ignore_eos=True,
                                               timeout_s=600))


def count_steps(engine, monkeypatch) -> list[int]:
    """Records, for each scheduler step, how many requests were running after it."""
    running: list[int] = []
    step = engine.scheduler.step

    def counted():
        done = step()
        running.append(len(engine.scheduler.running) + len(done))
        return done

    monkeypatch.setattr(engine.scheduler, "step", counted)
    return running


def test_concurrent_streams_are_batched(service, engine, monkeypatch):
    """Counted, not timed: one by one, 32 requests of 12 tokens need at least 384 scheduler steps."""
    _, grpc = urls(service)
    n_tokens, n_requests = 12, 32
    running = count_steps(engine, monkeypatch)
    with ThreadPoolExecutor(n_requests) as pool:
        outs = list(pool.map(lambda i: _stream(grpc, i, n_tokens), range(n_requests)))
    monkeypatch.undo()

    print(f"\n{n_requests} concurrent streams: {len(running)} scheduler steps, up to {max(running)} requests a step")
    assert all(out["generated_tokens"] == n_tokens for out in outs)
    assert all(out["finish_reason"] == "length" and out["text_output"] for out in outs)
    assert len(running) < n_requests * n_tokens / 2, f"{len(running)} steps for {n_requests} requests"
    assert max(running) >= n_requests // 4, f"at most {max(running)} requests ran together"

    _, m = wait_idle(engine.metrics, 10)
    assert m["live_requests"] == 0 and m["live_pages"] == 0 and m["kv_bytes_in_use"] == 0


def test_cancelled_grpc_stream_stops_within_steps(service, engine, monkeypatch):
    """A gRPC client that cancels its stream stops the generation within a few scheduler steps (it ran on to
    max_tokens: PyTriton's proxy dropped Triton's cancellation; trtkv's stub-side proxy passes it on)."""
    import tritonclient.grpc as grpcclient

    _, grpc = urls(service)
    results: queue.Queue = queue.Queue()
    conn = grpcclient.InferenceServerClient(grpc)
    conn.start_stream(callback=lambda result, error: results.put((result, error)))
    conn.async_stream_infer(service.model_name, client.grpc_inputs(
        {"text_input": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}),
        enable_empty_final_response=True)
    for _ in range(3):
        result, error = results.get(timeout=300)
        assert error is None
    running = count_steps(engine, monkeypatch)
    conn.stop_stream(cancel_requests=True)
    conn.close()
    _, m = wait_idle(engine.metrics, 60)  # hang guard; the request leaves within a few steps
    monkeypatch.undo()
    assert m["live_requests"] == 0 and m["live_pages"] == 0, m
    print(f"\ncancelled gRPC stream: {len(running)} scheduler steps after the cancel")
    assert len(running) <= 32, f"{len(running)} steps after the cancel (of up to 4,000)"
    assert client.collect(client.grpc_generate(grpc, PROMPT, max_tokens=2))["generated_tokens"] >= 1


def test_abandoned_stream_does_not_break_server(service, engine):
    _, grpc = urls(service)
    for event in client.grpc_generate(grpc, PROMPT, max_tokens=64, ignore_eos=True):
        assert event["text_output"]
        break  # the client goes away mid-generation
    _, m = wait_idle(engine.metrics, 60)
    assert m["live_pages"] == 0
    assert client.collect(client.grpc_generate(grpc, PROMPT, max_tokens=3))["generated_tokens"] >= 1


BAD_REQUESTS = [
    ({"max_tokens": 0}, "max_tokens must be between 1"),
    ({"max_tokens": 10**7}, "max_tokens must be between 1"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"seed": -3}, "seed must be a non-negative integer"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 10]"),
    ({"text_input": ""}, "text_input is empty"),
    ({"text_input": b"\xff\xfe broken"}, "not valid UTF-8"),
    ({"text_input": "word " * 9000}, "positions"),
]


@pytest.mark.parametrize("fields,message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_request_gets_clean_error(service, fields, message):
    _, grpc = urls(service)
    fields = {"text_input": PROMPT, "max_tokens": 4, **fields}
    prompt = fields.pop("text_input")
    with pytest.raises(ServerError) as err:
        list(client.grpc_generate(grpc, prompt, **fields))
    assert message in str(err.value) and "Traceback" not in str(err.value)


def test_malformed_requests_and_server_keeps_serving(service):
    import numpy as np
    import tritonclient.grpc as grpcclient

    http, grpc = urls(service)
    body = {"max_tokens": 4}  # no text_input
    with pytest.raises(ServerError, match="text_input"):
        client._post(http, f"/v2/models/{service.model_name}/generate", body, 30)
    with pytest.raises(ServerError, match="max_tokens must be an integer"):  # wrong JSON type for INT32
        client._post(http, f"/v2/models/{service.model_name}/generate",
                     {"text_input": PROMPT, "max_tokens": "many"}, 30)
    with pytest.raises(ServerError, match="text_input is empty"):
        list(client.http_generate_stream(http, "   ", max_tokens=4))

    wrong = grpcclient.InferInput("max_tokens", [1], "INT64")  # model expects INT32
    wrong.set_data_from_numpy(np.array([4], dtype=np.int64))
    with pytest.raises(ServerError, match="expects 'INT32'"):
        list(client.grpc_stream(grpc, service.model_name,
                                client.grpc_inputs({"text_input": PROMPT}) + [wrong], timeout_s=30))

    assert client.http_generate(http, PROMPT, max_tokens=3)["generated_tokens"] >= 1


def test_metrics_endpoints(service):
    _, grpc = urls(service)
    list(client.grpc_generate(grpc, PROMPT, max_tokens=2))
    triton = scrape_until(service.metrics_port, lambda t: "nv_inference_request_success" in t)
    assert "nv_inference_request_success" in triton
    ours = urllib.request.urlopen(f"http://{HOST}:{service.trtkv_metrics_port}/metrics",
                                  timeout=10).read().decode()
    for name in ("trtkv_kv_bytes_in_use", "trtkv_live_requests", "trtkv_evictions_total"):
        assert f'{name}{{model="{service.model_name}"}}' in ours


def test_deploy_templates_match_generator(tmp_path):
    from trtkv.serve.deploy import deploy

    model = deploy("/path/to/engine", tmp_path, "trtkv")
    template = ROOT / "deploy" / "triton" / "model_repository" / "trtkv"
    for rel in ("config.pbtxt", "1/model.py"):
        assert (model / rel).read_text() == (template / rel).read_text(), f"regenerate deploy/ {rel}"
    assert json.loads((template / "model.json").read_text())["engine"]


def test_deployed_repository_under_tritonserver(engine_dir, engine, tmp_path):
    from trtkv.serve.deploy import deploy, start_tritonserver

    deploy(engine_dir, tmp_path / "repo", "smol")
    http, grpc, metrics = free_ports(3)
    proc = start_tritonserver(tmp_path / "repo", host=HOST, http_port=http, grpc_port=grpc,
                              metrics_port=metrics, backends=tmp_path / "backends")
    try:
        wait_ready(f"{HOST}:{http}", "smol", 180, proc)
        def pool_bytes(text):  # no request made yet: the pool gauge shows the warm-up
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("trtkv_kv_pool_bytes{"))

        assert pool_bytes(scrape_until(metrics, pool_bytes)) > 0, "the deployed model said ready before it was warm"
        want = expected(engine, max_tokens=12)
        got = client.http_generate(f"{HOST}:{http}", PROMPT, model="smol", max_tokens=12)
        assert got["text_output"] == want.text
        assert got["generated_tokens"] == len(want.token_ids)
        streamed = client.collect(client.grpc_generate(f"{HOST}:{grpc}", PROMPT, model="smol",
                                                       max_tokens=12))
        assert streamed["text_output"] == want.text
        with pytest.raises(ServerError, match="max_tokens must be between 1"):
            client.http_generate(f"{HOST}:{http}", PROMPT, model="smol", max_tokens=-1)
        text = scrape_until(metrics, lambda t: "trtkv_requests_total" in t)
        assert 'trtkv_live_requests{model="smol"' in text and "trtkv_requests_total" in text
    finally:
        assert stop_process(proc) == 0


def test_serve_command_stops_cleanly_on_sigint(engine_dir):
    """Started as a non-interactive shell starts a background job (SIGINT ignored, inherited through exec), the
    server still stops on SIGINT: it installs its own handler (before, it ran on until killed)."""
    http, grpc, metrics, trtkv_metrics = free_ports(4)
    cmd = [sys.executable, "-m", "trtkv.serve", "serve", str(engine_dir), "--host", HOST,
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--trtkv-metrics-port", str(trtkv_metrics)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_ready(f"{HOST}:{http}", "trtkv", 180, proc)
        assert client.http_generate(f"{HOST}:{http}", PROMPT, max_tokens=2)["generated_tokens"] >= 1
    finally:
        code = stop_process(proc)
    log = proc.stdout.read().decode(errors="replace")
    assert code == 0, log[-3000:]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{HOST}:{http}/v2/health/live", timeout=2)
