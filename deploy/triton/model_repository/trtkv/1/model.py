"""Triton Python-backend entry point written by trtkv.serve.deploy.

The implementation lives in trtkv (trtkv/serve/triton_model.py) so that
upgrading trtkv upgrades this model; model.json names the engine.
"""

from trtkv.serve.triton_model import TritonPythonModel  # noqa: F401
