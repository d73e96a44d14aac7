"""Helpers shared by the serving tests: free ports, readiness, stopping, reading trtkv gauges."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
PROMPT = "What is 2+2? Answer briefly."


def http_json(port: int, method: str, path: str, body: bytes | None = None, headers=None,
              timeout: float = 120) -> tuple[int, dict]:
    """One HTTP request to ``HOST:port``: ``(status, JSON body)``, or ``{"raw": text}`` when the body is not JSON."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_ready(http_url: str, model: str, timeout_s: float, proc=None) -> None:
    """The model's own ready endpoint is the truth (/v2/health/ready answers before it loads)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{http_url} not ready after {timeout_s}s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 30, sig=signal.SIGINT) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def python_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def serve_command(*args) -> list[str]:
    return [sys.executable, "-m", "trtkv.serve", *map(str, args)]


def scrape_until(port: int, done, timeout_s: float = 15) -> str:
    """The metrics page at ``HOST:port`` once ``done(text)`` holds (or the last one read at the deadline).

    tritonserver opens its metrics port after the HTTP one, so a model can answer ready while
    the metrics port still refuses connections: a refusal is retried, not an error.
    """
    deadline, text = time.monotonic() + timeout_s, ""
    while True:
        try:
            text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10).read().decode()
        except OSError:
            pass
        if done(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)  # gauges refresh once a second


def gauges(port: int) -> dict[str, float]:
    """trtkv's gauges from its metrics endpoint (the engine lives in the server process)."""
    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(trtkv_\w+)\{[^}]*\} (\S+)$", text, re.M)}


def wait_idle(read, timeout_s: float, prefix: str = "") -> tuple[float, dict]:
    """Seconds until ``read()`` (an engine's metrics, or gauges named ``prefix`` + name) shows no live request and
    no live page (or the last reading on timeout). Both, not the requests alone: the engine's thread frees a finished
    request's pages just after the request leaves the scheduler."""
    t0 = time.monotonic()
    while True:
        g = read()
        if g.get(prefix + "live_requests") == 0 and g.get(prefix + "live_pages") == 0:
            return time.monotonic() - t0, g
        if time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, g
        time.sleep(0.1)


def wait_gauges_idle(port: int, timeout_s: float) -> tuple[float, dict]:
    """``wait_idle`` of the gauges at a server's trtkv metrics ``port``."""
    return wait_idle(lambda: gauges(port), timeout_s, "trtkv_")


def group_processes(pgid: int, wait_s: float = 5.0) -> list[int]:
    """Live (not zombie) processes of a process group, after giving a SIGKILL `wait_s` to land."""
    deadline = time.monotonic() + wait_s
    while True:
        out = []
        for p in Path("/proc").iterdir():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append(int(p.name))
            except (OSError, ValueError, IndexError):
                pass
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, ValueError, IndexError):
                pass
    return out
