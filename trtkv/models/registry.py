"""Model registry: alias -> source and architecture (``configs/models.yaml``), plus hub ids and local dirs."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trtkv.errors import TrtkvError
from trtkv.models.config import ModelArch
from trtkv.paths import CONFIGS_DIR


@dataclass
class ModelSpec:
    name: str  # alias, hub id, or local directory
    kind: str  # "pypi-gguf" | "hub" | "local"
    description: str = ""
    hf_id: str | None = None
    source: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] | None = None  # architecture, when known without downloading

    @property
    def arch(self) -> ModelArch:
        if self.config is None:
            raise TrtkvError(f"architecture of {self.name!r} is unknown until its config.json is available")
        return ModelArch.from_hf_config(self.config)

    def summary(self) -> dict[str, Any]:
        d = {"name": self.name, "kind": self.kind, "description": self.description, "hf_id": self.hf_id}
        d["source"] = self.source
        if self.config:
            a = self.arch
            d.update(architecture=a.architecture, layers=a.num_hidden_layers, kv_heads=a.num_key_value_heads,
                     head_dim=a.head_dim, params_b=round(approx_params(a) / 1e9, 3))
        return d


def approx_params(a: ModelArch) -> int:
    per_layer = a.hidden_size * a.head_dim * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
    per_layer += 3 * a.hidden_size * a.intermediate_size
    emb = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    return per_layer * a.num_hidden_layers + emb


def load_registry(path: Path | None = None) -> dict[str, ModelSpec]:
    path = path or CONFIGS_DIR / "models.yaml"
    raw = yaml.safe_load(path.read_text())
    out = {}
    for alias, e in raw.items():
        src = e.get("source", {})
        out[alias] = ModelSpec(alias, src.get("kind", "hub"), e.get("description", ""), e.get("hf_id"), src,
                               e.get("config"))
    return out


def resolve_model(name: str) -> ModelSpec:
    """An alias from the registry, an existing local directory, or a hub id (``org/name``)."""
    reg = load_registry()
    if name in reg:
        return reg[name]
    p = Path(name).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise TrtkvError(f"{p} has no config.json; point --model at a transformers checkpoint directory")
        import json

        return ModelSpec(str(p.resolve()), "local", f"local checkpoint {p}", None, {"path": str(p.resolve())},
                         json.loads(cfg.read_text()))
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return ModelSpec(name, "hub", f"hub model {name}", name, {"kind": "hub", "repo": name})
    raise TrtkvError(
        f"unknown model {name!r}: not an alias ({', '.join(reg)}), a local directory, or a hub id like org/name"
    )
