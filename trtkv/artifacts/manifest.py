"""``engine.json`` as typed sections: what was built (model), how the cache is driven (policy, cache),
what calibration fixed, and which kernels run.

Why one class: the manifest is written once by ``trtkv build`` and read by every tool (load, bench, eval,
serve, ``trtkv info``); a dict read in each place let a typo or a missing key surface as a ``KeyError``
deep in one of them. :meth:`EngineManifest.from_dict` is the only reader (one line per malformed field,
ending in "rebuild the engine") and :meth:`EngineManifest.to_dict` the only writer.

On disk this is engine format version 1, unchanged: engines built before the typed manifest load as they
are. ``calibration`` holds ThinKV's calibration artifact or, for other quantizing policies, only
``{"kv_amax": ...}`` (the static K/V scales measured at build time).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trtkv.artifacts.calibration import CalibrationArtifact, KVAmax
from trtkv.cache.manager import CacheConfig
from trtkv.errors import TrtkvError
from trtkv.models.config import ModelArch
from trtkv.models.quantized_weights import WEIGHT_FORMATS
from trtkv.models.loader import DTYPES

ENGINE_FORMAT_VERSION = 1
DEFAULT_KERNELS = {"paged_attention": "triton on CUDA, torch reference on CPU",
                   "kv_write": "triton on CUDA, torch reference on CPU"}


class _Bad:
    """Error factory for one manifest: ``bad("section.field", "what is wrong")``."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, key: str, why: str) -> TrtkvError:
        return TrtkvError(f"{self.where}: {key} {why}; rebuild the engine")


def _section(d: dict[str, Any], key: str, bad: _Bad) -> dict[str, Any]:
    s = d.get(key)
    if not isinstance(s, dict):
        raise TrtkvError(f"{bad.where} lacks its {key!r} section; rebuild the engine")
    return s


def _opt(s: dict[str, Any], key: str, types: tuple[type, ...], bad: _Bad, section: str, what: str) -> Any:
    v = s.get(key)
    if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
        raise bad(f"{section}.{key}", f"must be {what}, got {v!r}")
    return v


_ARCH_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "int | None": (int, type(None)),
               "list[int]": (list, int), "dict[str, Any] | None": (dict, type(None))}


def _arch(d: Any, bad: _Bad) -> ModelArch:
    """``model.arch``: every field of :class:`ModelArch` with the right JSON type (sizes positive)."""
    if not isinstance(d, dict):
        raise bad("model.arch", "is missing")
    for f in dataclasses.fields(ModelArch):
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise bad(f"model.arch.{f.name}", "is missing")
            continue
        v, types = d[f.name], _ARCH_TYPES.get(str(f.type), (object,))
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise bad(f"model.arch.{f.name}", f"has the wrong type ({v!r})")
        if str(f.type) == "int" and f.name != "head_dim" and v <= 0:
            raise bad(f"model.arch.{f.name}", f"must be positive, got {v}")
    try:
        return ModelArch.from_dict(d)
    except (TypeError, ValueError, TrtkvError) as e:
        raise bad("model.arch", f"is invalid ({e})") from None


@dataclass(frozen=True)
class ModelSection:
    alias: str
    architecture: str
    arch: ModelArch
    dtype: str  # fp32 | fp16 | bf16: the weights' and compute dtype chosen at build
    weights_sha256: str | None  # None for synthetic weights
    source: dict[str, Any] = field(default_factory=dict)  # the registry's source entry (kind, repo, ...)
    hf_id: str | None = None
    synthetic: bool = False
    synthetic_seed: int | None = None
    weights: str = "dense"  # dense (the dtype's weights) | int8 | int4 (trtkv/models/quantized_weights.py)
    quantized_sha256: str | None = None  # the stored codes' digest (None: dense, or synthetic weights)
    group_size: int | None = None  # int4: inputs sharing one scale
    tp: int = 1  # tensor-parallel ranks the model runs on by default (trtkv/models/sharding.py)

    @classmethod
    def from_dict(cls, s: dict[str, Any], bad: _Bad) -> ModelSection:
        for key in ("alias", "architecture"):
            if not isinstance(s.get(key), str) or not s[key]:
                raise bad(f"model.{key}", f"must be a non-empty string, got {s.get(key)!r}")
        if s.get("dtype") not in DTYPES:
            raise bad("model.dtype", f"must be one of {', '.join(DTYPES)}, got {s.get('dtype')!r}")
        arch = _arch(s.get("arch"), bad)
        synthetic = s.get("synthetic", False)
        if not isinstance(synthetic, bool):
            raise bad("model.synthetic", f"must be true or false, got {synthetic!r}")
        sha = _opt(s, "weights_sha256", (str,), bad, "model", "a hex digest")
        if sha is None and not synthetic:
            raise bad("model.weights_sha256", "is missing")
        weights = s.get("weights", "dense")
        if weights not in WEIGHT_FORMATS:
            raise bad("model.weights", f"must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        q_sha = _opt(s, "quantized_sha256", (str,), bad, "model", "a hex digest")
        if weights != "dense" and q_sha is None and not synthetic:
            raise bad("model.quantized_sha256", "is missing")
        group = _opt(s, "group_size", (int,), bad, "model", "an integer")
        if weights == "int4" and (group is None or group <= 0 or group % 2):
            raise bad("model.group_size", f"must be a positive even integer for int4 weights, got {group!r}")
        tp = s.get("tp", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise bad("model.tp", f"must be a positive integer, got {tp!r}")
        return cls(alias=s["alias"], architecture=s["architecture"], arch=arch, dtype=s["dtype"],
                   weights_sha256=sha, source=_opt(s, "source", (dict,), bad, "model", "an object") or {},
                   hf_id=_opt(s, "hf_id", (str,), bad, "model", "a string"), synthetic=synthetic,
                   synthetic_seed=_opt(s, "synthetic_seed", (int,), bad, "model", "an integer"), weights=weights,
                   quantized_sha256=q_sha, group_size=group, tp=tp)

    def to_dict(self) -> dict[str, Any]:
        return {"alias": self.alias, "source": self.source, "hf_id": self.hf_id, "architecture": self.architecture,
                "arch": self.arch.to_dict(), "dtype": self.dtype, "weights_sha256": self.weights_sha256,
                "synthetic": self.synthetic, "synthetic_seed": self.synthetic_seed,
                **({} if self.weights == "dense" else {"weights": self.weights, "group_size": self.group_size,
                                                       "quantized_sha256": self.quantized_sha256}),
                **({} if self.tp == 1 else {"tp": self.tp})}


@dataclass(frozen=True)
class PolicySection:
    name: str
    params: dict[str, Any] = field(default_factory=dict)  # the policy dataclass's fields (``policy.params()``)

    @classmethod
    def from_dict(cls, s: dict[str, Any], bad: _Bad) -> PolicySection:
        if not isinstance(s.get("name"), str) or not s["name"]:
            raise bad("policy.name", f"must be a policy name, got {s.get('name')!r}")
        return cls(s["name"], dict(_opt(s, "params", (dict,), bad, "policy", "an object") or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params}


@dataclass(frozen=True)
class CacheSection:
    """Cache settings fixed at build (``--set``); ``CacheConfig.validate_settings`` checks every one."""

    block_size: int = 8
    eviction: str = "inplace"
    residual_group: int = 1  # the policy's, recorded for readers of the manifest
    max_batch: int = 64
    max_pages: int | None = None
    kv_memory: int | None = None
    kv_memory_fraction: float = 0.9  # CUDA, kv_memory unset: share of free device memory for the KV pools
    demote: str = "none"  # evictions become moves to host tiers (trtkv/cache/tiers.py)
    host_kv_memory: int | None = None

    @classmethod
    def from_dict(cls, s: dict[str, Any], bad: _Bad) -> CacheSection:
        settings = {k: v for k, v in s.items() if k != "residual_group"}
        try:
            typed = CacheConfig.validate_settings(settings)
        except TrtkvError as e:
            raise TrtkvError(f"{bad.where}: {e}; rebuild the engine") from None
        g = s.get("residual_group", 1)
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise bad("cache.residual_group", f"must be a positive integer, got {g!r}")
        return cls(residual_group=g, **typed)

    def with_settings(self, settings: dict[str, Any]) -> CacheSection:
        """A copy with (validated) overrides, e.g. ``{"kv_memory": "2GiB"}`` at load time."""
        return dataclasses.replace(self, **CacheConfig.validate_settings(settings))

    def to_dict(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "eviction": self.eviction, "residual_group": self.residual_group,
                "max_batch": self.max_batch, "max_pages": self.max_pages, "kv_memory": self.kv_memory,
                "kv_memory_fraction": self.kv_memory_fraction, "demote": self.demote,
                "host_kv_memory": self.host_kv_memory}


@dataclass(frozen=True)
class EngineManifest:
    model: ModelSection
    policy: PolicySection
    cache: CacheSection
    calibration: CalibrationArtifact | None = None  # what the policy's ``load_calibration`` receives
    kv_amax: KVAmax | None = None  # static K/V scales for quantized formats (the artifact's, or measured at build)
    kernels: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_KERNELS))
    trtkv_version: str = ""
    created: str = ""
    format_selection: dict[str, Any] | None = None  # ThinKV formats chosen by measurement, with evidence

    @classmethod
    def from_dict(cls, m: Any, where: str = "engine.json") -> EngineManifest:
        bad = _Bad(where)
        if not isinstance(m, dict) or "format_version" not in m:
            raise TrtkvError(f"{where} is not a trtkv engine manifest; rebuild the engine")
        if m["format_version"] != ENGINE_FORMAT_VERSION:
            raise TrtkvError(f"engine format version {m['format_version']} is not supported by this trtkv "
                             f"(expects {ENGINE_FORMAT_VERSION}); rebuild the engine")
        model = ModelSection.from_dict(_section(m, "model", bad), bad)
        policy = PolicySection.from_dict(_section(m, "policy", bad), bad)
        cache = CacheSection.from_dict(_section(m, "cache", bad), bad)
        calibration, kv_amax = _calibration(m.get("calibration"), model.arch.num_hidden_layers, where)
        kernels = m.get("kernels") or {}
        if not isinstance(kernels, dict) or not all(isinstance(v, str) for v in kernels.values()):
            raise bad("kernels", "must map kernel names to descriptions")
        selection = m.get("format_selection")
        if selection is not None and not isinstance(selection, dict):
            raise bad("format_selection", "must be an object (the build's format measurement)")
        return cls(model, policy, cache, calibration, kv_amax, dict(kernels),
                   str(m.get("trtkv_version") or ""), str(m.get("created") or ""), selection)

    def to_dict(self) -> dict[str, Any]:
        if self.calibration is not None:
            cal = {**self.calibration.to_dict(), "kv_amax": self.kv_amax.to_dict() if self.kv_amax else None}
        else:
            cal = {"kv_amax": self.kv_amax.to_dict()} if self.kv_amax is not None else None
        return {"format_version": ENGINE_FORMAT_VERSION, "trtkv_version": self.trtkv_version,
                "created": self.created, "model": self.model.to_dict(), "policy": self.policy.to_dict(),
                "cache": self.cache.to_dict(), "calibration": cal, "kernels": self.kernels,
                **({"format_selection": self.format_selection} if self.format_selection is not None else {})}

    def replace(self, **changes: Any) -> EngineManifest:
        return dataclasses.replace(self, **changes)


def _calibration(c: Any, num_layers: int, where: str) -> tuple[CalibrationArtifact | None, KVAmax | None]:
    """The ``calibration`` entry: null, ``{"kv_amax": ...}`` alone, or a full calibration artifact."""
    if c is None:
        return None, None
    if not isinstance(c, dict):
        raise TrtkvError(f"{where}: calibration must be an object; rebuild the engine")
    where = f"in {where}"
    if set(c) == {"kv_amax"}:
        return None, KVAmax.from_dict(c["kv_amax"], where, num_layers)
    art = CalibrationArtifact.from_dict(c, num_layers, where)
    return art, art.kv_amax
