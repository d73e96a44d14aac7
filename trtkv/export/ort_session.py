"""The ONNX Runtime sessions of an export directory, opened for an engine (exporting first when the directory
has no export of this engine, or a stale one)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from trtkv.errors import TrtkvError
from trtkv.export import DEFAULT_OPSET
from trtkv.export.manifest import MANIFEST_NAME, ExportManifest, engine_fingerprint

DEFAULT_DIR = "onnx"  # inside the engine directory


class StepSessions:
    """``prefill.onnx`` and ``decode_step.onnx`` as ONNX Runtime sessions (CUDA EP where present, else CPU)."""

    def __init__(self, export_dir: Path, threads: int | None = None):
        self.dir = Path(export_dir)
        self.manifest = ExportManifest.read(self.dir)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3  # warnings about unused initializers and the like stay quiet
        available = ort.get_available_providers()
        self.providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        self.prefill = ort.InferenceSession(str(self.dir / "prefill.onnx"), opts, providers=self.providers)
        self.decode = ort.InferenceSession(str(self.dir / "decode_step.onnx"), opts, providers=self.providers)

    def run_prefill(self, ids: list[int]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.prefill.get_outputs()]
        return dict(zip(names, self.prefill.run(names, {"input_ids": np.asarray(ids, np.int64)})))

    def run_decode(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        return dict(zip(outputs, self.decode.run(outputs, feeds)))


def open_sessions(engine, export_dir: Path | None = None, opset: int = DEFAULT_OPSET) -> StepSessions:
    """Sessions for ``engine``: from ``export_dir`` (default ``ENGINE/onnx``), exported there first when it
    holds no export of this engine with these policy parameters."""
    from trtkv.export.exporter import check_exportable, export_engine

    check_exportable(engine)
    default = export_dir is None
    export_dir = Path(export_dir) if export_dir is not None else Path(engine.path) / DEFAULT_DIR
    params = engine.policy.params()
    fresh = False
    if (export_dir / MANIFEST_NAME).is_file():
        m = ExportManifest.read(export_dir)
        fresh = m.engine_fingerprint == engine_fingerprint(engine.path, params, m.opset, m.inline)
        if not fresh and not default:
            raise TrtkvError(f"{export_dir} holds an export of another engine or policy configuration; re-export "
                             f"with `trtkv export {engine.path} --out {export_dir}` or pass another directory")
    if not fresh:
        print(f"trtkv: exporting {engine.path} to {export_dir} for ONNX Runtime", file=sys.stderr)
        try:
            export_engine(engine, export_dir, opset=opset)
        except OSError as e:
            raise TrtkvError(f"cannot write the ONNX export to {export_dir} ({e.strerror or e}); pass another "
                             "directory (--onnx-dir)") from None
    return StepSessions(export_dir)
