"""The engines a bench or eval run measures: loading (shared weights, ``--set`` overrides routed to the
policies that take them), labels, and what an engine reads per decode step."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trtkv.errors import TrtkvError


@dataclass
class BenchEngine:
    label: str
    path: Path
    engine: Any  # trtkv.api.Engine

    @property
    def synthetic(self) -> bool:
        return self.engine.manifest.model.synthetic

    def describe(self) -> dict[str, Any]:
        e = self.engine
        mm = e.manifest.model
        return {"label": self.label, "path": str(self.path), "model": mm.alias, "architecture": mm.architecture,
                "dtype": str(e.core.dtype).replace("torch.", ""), "device": str(e.core.device),
                "policy": e.manifest.policy.name, "policy_params": e.policy.params(),
                "synthetic_weights": self.synthetic, "weights": mm.weights, "weight_bytes": step_weight_bytes(e),
                "block_size": e.core.cache.cfg.block_size, "residual_group": e.core.cache.cfg.residual_group,
                "runtime": e.runtime, "tp": e.tp, "kv_heads_per_rank": e.core.cache.cfg.num_kv_heads}


def load_engines(paths: list[Path], device: str | None = None, policy_overrides: dict[str, Any] | None = None,
                 share_weights: bool = True, runtimes: tuple[str, ...] = ("torch",), tp: int | None = None
                 ) -> list[BenchEngine]:
    """Load every engine (checking all paths first, so a typo fails before minutes of loading).

    ``policy_overrides`` (``--set``) go to each engine whose policy has that parameter (so a ThinKV-only
    setting can be passed in a run that also has full engines); a key no engine takes is an error, and a
    value ``@FILE`` is replaced by the file's text. With
    ``share_weights``, engines of the same model, weights and dtype share one model object: one copy of the
    weights exists (what lets several 8B engines share one GPU). Each engine is loaded once per runtime in
    ``runtimes`` (``torch``, ``onnxruntime``), labelled ``LABEL@RUNTIME`` when there are several. ``tp``: the
    tensor-parallel ranks every engine runs on (default: each engine's own)."""
    from trtkv.api import Engine
    from trtkv.artifacts.engine_dir import read_manifest
    from trtkv.policies import POLICIES, policy_fields

    if not paths:
        raise TrtkvError("name at least one engine directory")
    from trtkv.settings import split_settings

    manifests = [read_manifest(p) for p in paths]
    overrides, cache_ov = split_settings({k: _value_or_file(k, v) for k, v in (policy_overrides or {}).items()})
    per_engine, used = [], set()
    for m in manifests:
        cls = POLICIES.get(m.policy.name)
        mine = {k: v for k, v in overrides.items() if cls is not None and k in policy_fields(cls)}
        used |= set(mine)
        per_engine.append(mine or None)
    unused = sorted(set(overrides) - used)
    if unused:
        raise TrtkvError(f"--set {unused[0]}: none of the engines' policies "
                         f"({', '.join(sorted({m.policy.name for m in manifests}))}) has that parameter")
    out: list[BenchEngine] = []
    shared: dict[tuple, Any] | None = {} if share_weights else None
    n = len(paths) * len(runtimes)
    for lbl, p, ov in zip(_labels(paths), paths, per_engine):
        for rt in runtimes:
            eng = Engine.load(p, device=device, policy_overrides=ov, model_cache=shared,
                              cache_overrides=_share_of_device(cache_ov, len(out), n), runtime=rt, tp=tp)
            out.append(BenchEngine(f"{lbl}@{rt}" if len(runtimes) > 1 else lbl, Path(p), eng))
    return out


def _value_or_file(key: str, value: Any) -> Any:
    """``--set key=@FILE`` passes the file's text (e.g. a recorded ThinKV thought schedule)."""
    if not (isinstance(value, str) and value.startswith("@")):
        return value
    path = Path(value[1:]).expanduser()
    try:
        return path.read_text().strip()
    except OSError as e:
        raise TrtkvError(f"--set {key}=@{path}: cannot read the file ({e.strerror or e})") from None


def _share_of_device(cache_ov: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    """Engine ``i`` of ``n`` loaded into one process: unless the user sized the pools, each takes
    ``fraction / n`` of the device memory free before the first pool (``fraction / (n - i * fraction)`` of
    what is free when it loads), so the first engine does not take the default 90% and leave the others
    none, and the total stays ``fraction``. On CPU pools have a fixed default size and this is unused."""
    if n == 1 or any(k in cache_ov for k in ("kv_memory", "max_pages")):
        return cache_ov
    from trtkv.cache.config import CacheConfig

    frac = float(cache_ov.get("kv_memory_fraction", CacheConfig.kv_memory_fraction))
    return {**cache_ov, "kv_memory_fraction": frac / (n - i * frac)}


def _labels(paths: list[Path]) -> list[str]:
    names = [Path(p).resolve().name for p in paths]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def step_weight_bytes(engine) -> int:
    """Bytes of weights one decode step of ``engine`` reads, in the weight format it runs (one rank's slice
    under tensor parallelism)."""
    return engine.quantized_weight_bytes or weight_bytes(engine.model)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied embeddings once), less an untied
    input embedding table, of which a step reads only the rows of its tokens."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    emb = model.model.embed_tokens.weight
    lm = getattr(model, "lm_head", None)
    if lm is None or lm.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total
