"""``export.json``: what an export directory holds and how to drive it (typed, round-trips through JSON).

It names every graph input and output with dtype and shape (symbolic: ``batch``, ``prompt``,
``prompt_groups``, ``pages_l{L}_{fmt}``, ``groups_l{L}_{fmt}``, ``table_l{L}_{fmt}``, ``keys_l{L}``), the KV
geometry and storage formats, the per-(layer, format) static scales baked into the function attributes, the
policy, and the schema of every ``trtkv`` function the graphs call.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trtkv.export.layout import KVLayout, TensorSpec

MANIFEST_NAME = "export.json"
FORMAT_VERSION = 2  # 2: the graphs always return the raw K/V (prefill k, v; decode k_new, v_new); bf16 as int16


@dataclass(frozen=True)
class GraphFile:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict:
        return {"file": self.file, "inputs": [s.to_dict() for s in self.inputs],
                "outputs": [s.to_dict() for s in self.outputs]}

    @classmethod
    def from_dict(cls, d: dict) -> "GraphFile":
        return cls(d["file"], tuple(TensorSpec.from_dict(s) for s in d["inputs"]),
                   tuple(TensorSpec.from_dict(s) for s in d["outputs"]))


@dataclass(frozen=True)
class FunctionSchema:
    """A ``trtkv`` function as a plugin sees it: ordered input and output names, float attributes."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]


@dataclass
class ExportManifest:
    trtkv_version: str
    engine: str
    engine_fingerprint: str  # engine.json and the effective policy parameters: a mismatch means re-export
    model: str
    policy: str
    policy_params: dict[str, Any]
    kv: KVLayout
    scales: list[list[tuple[float, float]]]  # [layer][format index] -> (scale_k, scale_v)
    opset: int
    inline: bool
    graphs: dict[str, GraphFile]
    functions: list[FunctionSchema] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("kv", "graphs", "functions")}
        d["kv"] = self.kv.to_dict()
        d["graphs"] = {k: g.to_dict() for k, g in self.graphs.items()}
        d["functions"] = [asdict(f) for f in self.functions]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ExportManifest":
        d = dict(d)
        d["kv"] = KVLayout.from_dict(d["kv"])
        d["graphs"] = {k: GraphFile.from_dict(g) for k, g in d["graphs"].items()}
        d["functions"] = [FunctionSchema(f["name"], tuple(f["inputs"]), tuple(f["outputs"]), tuple(f["attributes"]))
                          for f in d.get("functions", [])]
        d["scales"] = [[tuple(s) for s in row] for row in d["scales"]]
        return cls(**d)

    def write(self, out_dir: Path) -> Path:
        path = Path(out_dir) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        return path

    @classmethod
    def read(cls, out_dir: Path) -> "ExportManifest":
        return cls.from_dict(json.loads((Path(out_dir) / MANIFEST_NAME).read_text()))


def engine_fingerprint(engine_dir: Path, policy_params: dict[str, Any], opset: int, inline: bool) -> str:
    """What an export depends on: the engine manifest, the policy parameters in effect, opset, inlining and the
    export format version (an export written by an older trtkv is re-exported)."""
    h = hashlib.sha256((Path(engine_dir) / "engine.json").read_bytes())
    h.update(json.dumps({"policy": policy_params, "opset": opset, "inline": inline, "format": FORMAT_VERSION},
                        sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]
