"""``trtkv export``: the prefill and decode steps as ONNX graphs whose KV plugins are ``trtkv``-domain functions,
the ONNX Runtime executor that runs them inside trtkv's scheduler, and the Polygraphy check (docs/deploy.md).

Needs the ``onnx`` extra; ``require_onnx`` turns its absence into one clear error line. Modules here import
onnx / onnxscript / onnxruntime at top level, so import them only after ``require_onnx()``.
"""
from __future__ import annotations

import importlib.util

from trtkv.errors import TrtkvError

ONNX_EXTRA = ("onnx", "onnxscript", "onnxruntime", "polygraphy")
DEFAULT_OPSET = 20  # the exported graphs' default-domain opset (--opset picks 18..23)


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require_onnx(packages: tuple[str, ...] = ONNX_EXTRA) -> None:
    """Raise one ``TrtkvError`` line naming what is missing when the ``onnx`` extra is not installed."""
    missing = [p for p in packages if not _importable(p)]
    if missing:
        raise TrtkvError(f"{', '.join(missing)} not installed: the ONNX export and runtime need the onnx extra; "
                         "install it with `pip install 'trtkv[onnx]'`")
