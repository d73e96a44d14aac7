"""The engine directory: ``engine.json`` (what was built, how) next to ``weights/`` and ``tokenizer/``.

Reading goes through :class:`~trtkv.artifacts.manifest.EngineManifest` (format version, every field) and
checks the weights hash; each failure is one clear line ending in what to do.
"""
from __future__ import annotations

import json
from pathlib import Path

from trtkv.artifacts.manifest import ENGINE_FORMAT_VERSION, EngineManifest
from trtkv.errors import TrtkvError
from trtkv.models.quantized_weights import quantized_file
from trtkv.models.loader import sha256_files, weight_files

MANIFEST = "engine.json"

__all__ = ["ENGINE_FORMAT_VERSION", "MANIFEST", "EngineManifest", "read_manifest", "verify_quantized_weights",
           "verify_weights", "write_manifest"]


def read_manifest(path: str | Path) -> EngineManifest:
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
    return EngineManifest.from_dict(m, where=str(mf))


def verify_weights(path: Path, manifest: EngineManifest) -> list[Path]:
    """The weight files, after checking their sha256 against the manifest."""
    model = manifest.model
    if model.synthetic:
        return []
    wdir = path / "weights"
    if not wdir.is_dir():
        raise TrtkvError(f"{path} has no weights/ directory; rebuild the engine")
    files = weight_files(wdir)
    digest = sha256_files(files)
    if digest != model.weights_sha256:
        raise TrtkvError(f"weights hash mismatch in {wdir} (expected {str(model.weights_sha256)[:12]}…, "
                         f"found {digest[:12]}…); the weights changed since the build — rebuild the engine")
    return files


def verify_quantized_weights(path: Path, manifest: EngineManifest) -> Path:
    """The stored quantized weights' file (``--weights int8|int4``), after checking its sha256 against the
    manifest."""
    fmt = manifest.model.weights
    f = path / quantized_file(fmt)
    if not f.is_file():
        raise TrtkvError(f"{path} was built with --weights {fmt} but has no {quantized_file(fmt)}; rebuild the engine")
    digest = sha256_files([f])
    if digest != manifest.model.quantized_sha256:
        raise TrtkvError(f"{fmt} weights hash mismatch in {f} (expected {str(manifest.model.quantized_sha256)[:12]}…, "
                         f"found {digest[:12]}…); rebuild the engine")
    return f


def write_manifest(path: Path, manifest: EngineManifest) -> None:
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    tmp.replace(path / MANIFEST)


def engine_tp(tp: int | None, engines: list) -> int:
    """The tensor-parallel ranks a command runs ``engines`` on: ``tp`` when given, else their ``--tp`` (one value
    for all of them; 1 when none is an engine directory yet, so a bad path fails where it is read)."""
    if tp is not None:
        return tp
    sizes = {read_manifest(e).model.tp for e in engines if Path(e).is_dir()}
    if len(sizes) > 1:
        raise TrtkvError(f"the engines were built for different --tp ({', '.join(map(str, sorted(sizes)))}); "
                         "pass --tp N")
    return sizes.pop() if sizes else 1
