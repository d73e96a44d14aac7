"""trtkv gauges in Prometheus text format, on a small HTTP endpoint of their own.

PyTriton runs the Triton side of a model inside its own proxy model in the
Python-backend stub, so its `pb_utils.MetricFamily` is out of reach from the
process that owns the engine; the engine's gauges are therefore served next to
Triton's metrics port (see docs/serving.md).  The deployed Python-backend model
registers the same gauges with `pb_utils.MetricFamily` instead.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

# engine.metrics() key -> (prometheus name, help, type)
GAUGES = {
    "kv_bytes_in_use": ("trtkv_kv_bytes_in_use", "Bytes of KV cache held by live requests", "gauge"),
    "live_requests": ("trtkv_live_requests", "Requests being generated or queued", "gauge"),
    "live_pages": ("trtkv_live_pages", "KV-cache pages held by live requests", "gauge"),
    "evictions_total": ("trtkv_evictions_total", "KV entries evicted by the compression policy", "counter"),
    "requests_total": ("trtkv_requests_total", "Requests submitted to the engine", "counter"),
    "kv_bytes_device": ("trtkv_kv_bytes_device", "Device KV bytes of live requests (T0 pages + staging)", "gauge"),
    "kv_bytes_host": ("trtkv_kv_bytes_host", "Host-tier KV bytes of live requests (T1 + T2)", "gauge"),
    "tokens_host": ("trtkv_tokens_host", "Tokens held in the host tiers (per layer) by live requests", "gauge"),
    "transfer_bytes_total": ("trtkv_kv_transfer_bytes_total", "KV bytes copied between device and host tiers",
                             "counter"),
    "kv_pool_bytes": ("trtkv_kv_pool_bytes", "Bytes the KV pools reserved (allocated by the warm-up, used or not)",
                      "gauge"),
}


def render(metrics: dict, labels: dict[str, str] | None = None) -> str:
    """Prometheus exposition text for the known keys of `engine.metrics()`."""
    lab = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
    lab = "{" + lab + "}" if lab else ""
    lines = []
    for key, (name, help_, kind) in GAUGES.items():
        if key in metrics:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                      f"{name}{lab} {float(metrics[key]):g}"]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves `GET /metrics` from a callable; runs in a daemon thread."""

    def __init__(self, host: str, port: int, source: Callable[[], str]):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server API
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = source().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="trtkv-metrics")

    def start(self) -> "MetricsServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
