#!/usr/bin/env bash
# Serve a model repository written by `python -m trtkv.serve deploy` with the
# tritonserver bundled in nvidia-pytriton.  Run it with the Python environment
# that has trtkv, torch and nvidia-pytriton (PYTHON, default: python3): that
# interpreter decides the backend stub, LD_LIBRARY_PATH, PATH and PYTHONPATH
# (see docs/serving.md).  Ctrl-C stops tritonserver.
#   deploy/triton/run_tritonserver.sh REPO [--http-port 8000 --grpc-port 8001 --metrics-port 8002 --host 0.0.0.0]
set -euo pipefail
repo="${1:?usage: $0 MODEL_REPOSITORY [--http-port N] [--grpc-port N] [--metrics-port N] [--host ADDR]}"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" -m trtkv.serve tritonserver "$repo" "$@"
