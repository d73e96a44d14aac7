"""The ``trtkv`` function library of an exported model: the FunctionProtos its graphs call, and the node
schemas the exporter needs while it emits calls to them.

The PyTorch exporter emits one ``trtkv::<Function>`` node per plugin call (see ``translation.py``); it needs
an ONNX op schema for that, which ``registered_schemas`` provides for the duration of the export. The
function bodies are attached afterwards (``attach_functions``) rather than by the exporter, whose opset
conversion would inline them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import onnx
import onnxscript
from onnx import defs

from trtkv.export.attention_functions import TRTKV
from trtkv.export.format_functions import format_functions

DOMAIN = TRTKV.domain
DOMAIN_VERSION = TRTKV.version
_ALL_TENSOR_TYPES = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "double", "uint8", "int8", "int16",
                                              "int32", "int64", "bool")]


def library(formats: Iterable[str]) -> list[onnxscript.OnnxFunction]:
    """Every function the graphs of an engine storing ``formats`` may call (helpers first, no duplicates)."""
    seen: dict[str, onnxscript.OnnxFunction] = {}
    for name in formats:
        for fn in format_functions(name).all:
            seen.setdefault(fn.name, fn)
    return list(seen.values())


def function_proto(fn: onnxscript.OnnxFunction, opset: int) -> onnx.FunctionProto:
    """``fn`` as a FunctionProto importing the model's default-domain opset (the bodies use ops whose
    semantics are the same from opset 18 on; the checker verifies each against the model's version)."""
    proto = fn.to_function_proto()
    imports = {o.domain: o.version for o in proto.opset_import}
    imports[""] = opset
    imports[DOMAIN] = DOMAIN_VERSION
    del proto.opset_import[:]
    proto.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(imports.items()))
    return proto


def attach_functions(model: onnx.ModelProto, formats: Iterable[str]) -> None:
    """Add the function bodies the graph calls (transitively) and the ``trtkv`` opset import."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    by_name = {fn.name: fn for fn in library(formats)}
    called = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    needed: list[str] = []
    while called:
        name = called.pop()
        if name in needed:
            continue
        needed.append(name)
        called |= {n.op_type for n in by_name[name].to_function_proto().node if n.domain == DOMAIN}
    order = [name for name in by_name if name in needed]  # helpers before their callers
    existing = {f.name for f in model.functions}
    model.functions.extend(function_proto(by_name[n], opset) for n in order if n not in existing)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))


def _schema(fn: onnxscript.OnnxFunction) -> defs.OpSchema:
    proto = fn.to_function_proto()
    params = [defs.OpSchema.FormalParameter(name, f"T{i}") for i, name in enumerate(proto.input)]
    outs = [defs.OpSchema.FormalParameter(name, f"O{i}") for i, name in enumerate(proto.output)]
    types = [(f"T{i}", _ALL_TENSOR_TYPES, "") for i in range(len(proto.input))]
    types += [(f"O{i}", _ALL_TENSOR_TYPES, "") for i in range(len(proto.output))]
    # every trtkv function attribute is a float (sm_scale, scale_k, scale_v)
    attributes = [defs.OpSchema.Attribute(name, defs.OpSchema.AttrType.FLOAT, "") for name in proto.attribute]
    return defs.OpSchema(fn.name, DOMAIN, DOMAIN_VERSION, inputs=params, outputs=outs, type_constraints=types,
                         attributes=attributes)


@contextlib.contextmanager
def registered_schemas(formats: Iterable[str]) -> Iterator[None]:
    """Register an op schema per ``trtkv`` function while the exporter runs, and remove them after (checkers
    and runtimes then see the model's own function definitions)."""
    added = []
    try:
        for fn in library(formats):
            if not defs.has(fn.name, DOMAIN_VERSION, DOMAIN):
                defs.register_schema(_schema(fn))
                added.append(fn.name)
        yield
    finally:
        for name in added:
            defs.deregister_schema(name, DOMAIN_VERSION, DOMAIN)
