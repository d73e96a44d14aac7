"""The engine directory: ``engine.json`` (what was built, how) next to ``weights/`` and ``tokenizer/``.

Loading checks the format version and the weights hash and fails with one clear line on mismatch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trtkv.errors import TrtkvError
from trtkv.models.loader import sha256_files, weight_files

ENGINE_FORMAT_VERSION = 1
MANIFEST = "engine.json"


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise TrtkvError(f"no engine at {path}; build one with `trtkv build --model NAME --policy POLICY --out {path}`")
    if not path.is_dir():
        raise TrtkvError(f"{path} is not an engine directory")
    mf = path / MANIFEST
    if not mf.is_file():
        raise TrtkvError(f"{path} has no {MANIFEST}; it is not a trtkv engine (rebuild it with `trtkv build`)")
    try:
        m = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TrtkvError(f"{mf} is corrupt ({e.__class__.__name__}: {e}); rebuild the engine") from None
    if not isinstance(m, dict) or "format_version" not in m:
        raise TrtkvError(f"{mf} is not a trtkv engine manifest; rebuild the engine")
    if m["format_version"] != ENGINE_FORMAT_VERSION:
        raise TrtkvError(f"engine format version {m['format_version']} is not supported by this trtkv "
                         f"(expects {ENGINE_FORMAT_VERSION}); rebuild the engine")
    for key in ("model", "policy", "cache"):
        if not isinstance(m.get(key), dict):
            raise TrtkvError(f"{mf} lacks its {key!r} section; rebuild the engine")
    return m


def verify_weights(path: Path, manifest: dict[str, Any]) -> list[Path]:
    """The weight files, after checking their sha256 against the manifest."""
    model = manifest["model"]
    if model.get("synthetic"):
        return []
    wdir = path / "weights"
    if not wdir.is_dir():
        raise TrtkvError(f"{path} has no weights/ directory; rebuild the engine")
    files = weight_files(wdir)
    digest = sha256_files(files)
    if digest != model.get("weights_sha256"):
        raise TrtkvError(f"weights hash mismatch in {wdir} (expected {str(model.get('weights_sha256'))[:12]}…, "
                         f"found {digest[:12]}…); the weights changed since the build — rebuild the engine")
    return files


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    manifest = {"format_version": ENGINE_FORMAT_VERSION, **manifest}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    tmp.replace(path / MANIFEST)
