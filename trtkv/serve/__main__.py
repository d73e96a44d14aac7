"""`python -m trtkv.serve`: serve, deploy, or run a deployed repository.

Kept apart from trtkv's main CLI so serving's optional dependencies
(nvidia-pytriton, tritonclient) are only imported when asked for.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import click

from trtkv.errors import TrtkvError


PORT = click.IntRange(1, 65535)


def _ports(f):
    for opt in reversed([
        click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind."),
        click.option("--http-port", type=PORT, default=8000, show_default=True),
        click.option("--grpc-port", type=PORT, default=8001, show_default=True),
        click.option("--metrics-port", type=PORT, default=8002, show_default=True),
    ]):
        f = opt(f)
    return f


def _open_api(f):
    return click.option("--open-api", multiple=True, metavar="CATEGORY",
                        help="Leave a Triton API category open (closed by default: shared-memory, "
                             "model-repository, statistics, trace, logging). Repeatable.")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Serve trtkv engines with Triton Inference Server."""


@main.command()
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@_ports
@click.option("--trtkv-metrics-port", type=PORT, default=None,
              help="Port of the trtkv gauges endpoint [metrics port + 1].")
@click.option("--model-name", default=None, help="Triton model name [trtkv].")
@click.option("--log-verbose", type=int, default=0, help="tritonserver verbosity.")
@_open_api
@click.option("--tp", type=int, default=None, metavar="N",
              help="Tensor-parallel ranks (processes, one per GPU on CUDA) [the engine's --tp, else 1].")
@click.option("--runtime", type=click.Choice(["torch", "graph"]), default="torch", show_default=True,
              help="What runs the model steps: PyTorch, or each steady decode step as one compiled program.")
def serve(engine, host, http_port, grpc_port, metrics_port, trtkv_metrics_port, model_name, log_verbose,
          open_api, tp, runtime):
    """Serve ENGINE until Ctrl-C/SIGTERM: HTTP (OpenAI /v1 + KServe generate) and Triton gRPC."""
    from trtkv.serve.triton_server import serve as run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(run(engine, host, http_port, grpc_port, metrics_port, model_name=model_name,
                 trtkv_metrics_port=trtkv_metrics_port, log_verbose=log_verbose, open_apis=open_api, tp=tp,
                 runtime=runtime))


@main.command()
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.argument("repo", type=click.Path(file_okay=False), required=False)
@click.option("--out", "out", type=click.Path(file_okay=False), default=None, help="Model repository to write.")
@click.option("--model-name", default="trtkv", show_default=True)
def deploy(engine, repo, out, model_name):
    """Write a Triton model repository (--out REPO) serving ENGINE."""
    from trtkv.serve.deploy import deploy as write

    target = out or repo
    if not target:
        raise click.UsageError("give the repository to write with --out REPO")
    click.echo(f"model written to {write(engine, target, model_name)}")


@main.command()
@click.argument("repo", type=click.Path(exists=True, file_okay=False))
@_ports
@_open_api
@click.option("--http/--no-http", "allow_http", default=True, show_default=True,
              help="Serve Triton's HTTP endpoint (its JSON parser cannot be bounded; see docs/serving.md).")
def tritonserver(repo, host, http_port, grpc_port, metrics_port, open_api, allow_http):
    """Run the bundled tritonserver on REPO with this Python's backend stub."""
    from trtkv.serve.deploy import start_tritonserver
    from trtkv.serve.http_front import check_port_free, distinct_ports

    ports = ([(http_port, "--http-port")] if allow_http else []) + [(grpc_port, "--grpc-port"),
                                                                     (metrics_port, "--metrics-port")]
    distinct_ports(ports)
    for port, option in ports:
        check_port_free(host, port, option)
    proc = start_tritonserver(repo, host=host, http_port=http_port, grpc_port=grpc_port,
                              metrics_port=metrics_port, open_apis=open_api, allow_http=allow_http)
    stopping: list[float] = []

    def stop(*_):
        if not stopping:
            stopping.append(time.monotonic())

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    interrupted = False
    while True:
        proc.protect()
        try:
            rc = proc.wait(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            pass
        if stopping and not interrupted:
            proc.drain()  # open streams get an error response while their connections still exist
            if time.monotonic() - stopping[0] > DRAIN_S:
                proc.send_signal(signal.SIGINT)  # once: a second SIGINT makes Triton exit at once
                interrupted = True
        if interrupted and time.monotonic() - stopping[0] > 40:  # Triton's own exit timeout is 10 s
            proc.kill()
    leftovers = proc.cleanup()
    sys.exit(_report_exit(rc, bool(stopping), leftovers))


DRAIN_S = 1.0


def _report_exit(rc: int, requested: bool, leftovers: list[str]) -> int:
    """tritonserver's status as ours, with one line when it was not a clean, requested stop."""
    if leftovers:
        click.echo(f"trtkv: cleaned up after tritonserver: {', '.join(leftovers)}", err=True)
    if rc == 0:
        return 0
    what = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"status {rc}"
    when = "while stopping" if requested else "unexpectedly"
    click.echo(f"trtkv: error: tritonserver exited {when} with {what}; see its log above", err=True)
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    try:
        main()
    except TrtkvError as e:
        click.echo(f"trtkv: error: {e}", err=True)
        sys.exit(2)
