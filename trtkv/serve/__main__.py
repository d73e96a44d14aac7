"""`python -m trtkv.serve`: serve, deploy, or run a deployed repository.

Kept apart from trtkv's main CLI so serving's optional dependencies
(nvidia-pytriton, tritonclient) are only imported when asked for.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import click

from trtkv.errors import TrtkvError


def _ports(f):
    for opt in reversed([
        click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind."),
        click.option("--http-port", type=int, default=8000, show_default=True),
        click.option("--grpc-port", type=int, default=8001, show_default=True),
        click.option("--metrics-port", type=int, default=8002, show_default=True),
    ]):
        f = opt(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Serve trtkv engines with Triton Inference Server."""


@main.command()
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@_ports
@click.option("--trtkv-metrics-port", type=int, default=None,
              help="Port of the trtkv gauges endpoint [metrics port + 1].")
@click.option("--model-name", default=None, help="Triton model name [trtkv].")
@click.option("--log-verbose", type=int, default=0, help="tritonserver verbosity.")
def serve(engine, host, http_port, grpc_port, metrics_port, trtkv_metrics_port, model_name, log_verbose):
    """Serve ENGINE with PyTriton until Ctrl-C."""
    from trtkv.serve.triton_server import serve as run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run(engine, host, http_port, grpc_port, metrics_port, model_name=model_name,
        trtkv_metrics_port=trtkv_metrics_port, log_verbose=log_verbose)


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
def tritonserver(repo, host, http_port, grpc_port, metrics_port):
    """Run the bundled tritonserver on REPO with this Python's backend stub."""
    from trtkv.serve.deploy import start_tritonserver

    proc = start_tritonserver(repo, host=host, http_port=http_port, grpc_port=grpc_port,
                              metrics_port=metrics_port)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGINT))
    try:
        sys.exit(proc.wait())
    except KeyboardInterrupt:  # tritonserver runs in its own session: forward
        proc.send_signal(signal.SIGINT)
        try:
            sys.exit(proc.wait(timeout=30))
        except subprocess.TimeoutExpired:
            proc.kill()
            sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except TrtkvError as e:
        click.echo(f"trtkv: error: {e}", err=True)
        sys.exit(2)
