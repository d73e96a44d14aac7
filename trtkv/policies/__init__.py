"""Policy registry: name -> policy class. Adding a policy = its file + one line here + the test matrix."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import importlib

from trtkv.errors import TrtkvError
from trtkv.policies.base import KVPolicy, LayerStats, StatsRequest, StepStats

# One line per policy: "module:Class". Adding a policy = its file + one line here + one test-matrix entry.
POLICY_CLASSES = (
    "trtkv.policies.full:FullPolicy",
    "trtkv.policies.streamingllm:StreamingLLMPolicy",
    "trtkv.policies.thinkv:ThinKVPolicy",
    "trtkv.policies.thinkv:ThinKVTBQPolicy",
    "trtkv.policies.thinkv:ThinKVTBEPolicy",
    "trtkv.policies.h2o:H2OPolicy",
    "trtkv.policies.snapkv:SnapKVPolicy",
    "trtkv.policies.tova:TOVAPolicy",
    "trtkv.policies.rkv:RKVPolicy",
    "trtkv.policies.kivi:KIVIPolicy",
    "trtkv.policies.lazyeviction:LazyEvictionPolicy",
    "trtkv.policies.ams:AMSPolicy",
    "trtkv.policies.random:RandomPolicy",
    "trtkv.policies.pyramidkv:PyramidKVPolicy",
    "trtkv.policies.tiered:TieredPolicy",
    "trtkv.policies.arborkv:ArborKVPolicy",
)

POLICIES: dict[str, type[KVPolicy]] = {}


def register_policy(cls: type[KVPolicy]) -> type[KVPolicy]:
    POLICIES[cls.name] = cls
    return cls


for _entry in POLICY_CLASSES:
    _module, _cls = _entry.split(":")
    register_policy(getattr(importlib.import_module(_module), _cls))


def policy_fields(cls: type[KVPolicy]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def _coerce(cls: type[KVPolicy], key: str, value: Any) -> Any:
    hints = typing.get_type_hints(cls)
    t = hints[key]
    if not isinstance(value, str):
        return value
    text = value.strip()
    import types

    is_union = typing.get_origin(t) in (typing.Union, types.UnionType)
    args = typing.get_args(t) if is_union else ()
    if text.lower() in ("none", "null") and type(None) in args:
        return None
    base = next((a for a in args if a is not type(None)), t) if is_union else t
    try:
        if base is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if typing.get_origin(base) in (tuple, list):
            inner = typing.get_args(base)[0] if typing.get_args(base) else str
            parts = [p for p in text.replace(";", ",").split(",") if p.strip()]
            return tuple(inner(p.strip()) for p in parts)
    except ValueError:
        raise TrtkvError(f"--set {key}={value}: expected {getattr(base, '__name__', base)}") from None
    return text


def make_policy(name: str, params: dict[str, Any] | None = None) -> KVPolicy:
    """Instantiate a policy by name; unknown keys and invalid values give one clear error line."""
    if name not in POLICIES:
        raise TrtkvError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    fields = policy_fields(cls)
    kwargs = {}
    for k, v in (params or {}).items():
        if k not in fields:
            raise TrtkvError(f"policy {name!r} has no parameter {k!r}; it takes: {', '.join(fields)}")
        kwargs[k] = _coerce(cls, k, v)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, AssertionError) as e:
        raise TrtkvError(f"invalid parameters for policy {name!r}: {e}") from None


def describe_policies() -> list[dict[str, Any]]:
    out = []
    for name, cls in sorted(POLICIES.items()):
        params = {}
        for f in policy_fields(cls).values():
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            params[f.name] = default
        out.append({"name": name, "description": cls.description, "params": params})
    return out


__all__ = ["KVPolicy", "LayerStats", "StatsRequest", "StepStats", "POLICIES", "make_policy", "register_policy",
           "describe_policies"]
