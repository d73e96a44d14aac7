"""One step graph to one ``.onnx`` file: ``torch.onnx.export(dynamo=True)`` with the ``trtkv`` translation
table, the ``trtkv`` function bodies attached, optionally inlined, checked with ``onnx.checker`` (full check)
and saved with its weights as external data.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import onnx.inliner
import torch

from trtkv.errors import TrtkvError
from trtkv.export import DEFAULT_OPSET
from trtkv.export.functions import attach_functions, registered_schemas
from trtkv.export.layout import TensorSpec
from trtkv.export.translation import translation_table

MIN_OPSET, MAX_OPSET = 18, 23  # the function bodies' ops keep their semantics across these
# example sizes of the symbolic dimensions (distinct, and never 0 or 1, which torch.export would specialise)
EXAMPLE_SIZES = {"batch": 2, "prompt": 37, "pages": 5, "groups": 4, "table": 3}
ONNX_DTYPE = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
              "bfloat16": onnx.TensorProto.BFLOAT16, "uint8": onnx.TensorProto.UINT8, "int16": onnx.TensorProto.INT16,
              "int32": onnx.TensorProto.INT32, "int64": onnx.TensorProto.INT64, "bool": onnx.TensorProto.BOOL}
_TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
                "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}


def _size(dim: int | str) -> int:
    return dim if isinstance(dim, int) else EXAMPLE_SIZES[dim.split("_")[0]]


def example_input(spec: TensorSpec, vocab_size: int, group: int) -> torch.Tensor:
    """A plausible tensor for tracing: in-range ids, page ids, group indices and buffer fill."""
    shape = tuple(_size(d) for d in spec.shape)
    dtype = _TORCH_DTYPE[spec.dtype]
    leaf = spec.name.rsplit(".", 1)[-1]
    gen = torch.Generator().manual_seed(0)
    if leaf in ("input_ids",):
        return torch.randint(0, vocab_size, shape, generator=gen)
    if leaf == "positions":
        return torch.arange(40, 40 + shape[0])
    if leaf == "write_format":
        return torch.zeros(shape, dtype=torch.int64)
    if leaf == "buffer_len":
        return torch.tensor([0, group - 1][: shape[0]], dtype=torch.int64)
    if leaf == "block_table":
        return torch.randint(0, EXAMPLE_SIZES["pages"], shape, generator=gen, dtype=torch.int32)
    if leaf == "k_group":
        return torch.randint(0, EXAMPLE_SIZES["groups"], shape, generator=gen, dtype=torch.int32)
    if leaf == "valid":
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)  # bits past the page size: ignored
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 256, shape, generator=gen).to(dtype)


def dynamic_shapes(specs: list[TensorSpec]) -> tuple:
    dims: dict[str, torch.export.Dim] = {}
    out = []
    for s in specs:
        out.append({i: dims.setdefault(d, torch.export.Dim(d)) for i, d in enumerate(s.shape) if isinstance(d, str)})
    return tuple(out)


def _complete_types(model, outputs: list[TensorSpec]) -> None:
    """Outputs of the ``trtkv`` nodes come without an element type (the exporter knows only their shapes):
    graph outputs take theirs from the layout; intermediate ones are left to shape inference."""
    import onnx_ir as ir

    by_name = {s.name: s for s in outputs}
    for node in model.graph:
        for value in node.outputs:
            if value.type is not None:
                continue
            if value.name in by_name:
                value.type = ir.TensorType(ir.DataType(ONNX_DTYPE[by_name[value.name].dtype]))
            else:
                value.shape = None


def _for_signature(module: torch.nn.Module, shapes: tuple) -> tuple:
    """A ``forward(*inputs)`` takes its dynamic shapes as one tuple for the var-positional parameter."""
    import inspect

    params = inspect.signature(module.forward).parameters.values()
    return (shapes,) if any(p.kind is p.VAR_POSITIONAL for p in params) else shapes


def export_graph(module: torch.nn.Module, inputs: list[TensorSpec], outputs: list[TensorSpec], path: Path,
                 formats: tuple[str, ...], vocab_size: int, group: int, opset: int = DEFAULT_OPSET,
                 inline: bool = False) -> onnx.ModelProto:
    """Export ``module`` (a step graph) to ``path`` (+ ``path.data`` holding the weights); returns the model
    without its weights loaded."""
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise TrtkvError(f"--opset {opset} is not supported; choose {MIN_OPSET}..{MAX_OPSET}")
    args = tuple(example_input(s, vocab_size, group) for s in inputs)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with registered_schemas(formats), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, custom_translation_table=translation_table(),
            dynamic_shapes=_for_signature(module, dynamic_shapes(inputs)), input_names=[s.name for s in inputs],
            output_names=[s.name for s in outputs], opset_version=opset, optimize=False, verbose=False)
    _complete_types(program.model, outputs)
    model = program.model_proto
    attach_functions(model, formats)
    if inline:
        model = onnx.inliner.inline_local_functions(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.name + ".data"
    (path.parent / data).unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
    onnx.checker.check_model(str(path), full_check=True)
    return onnx.load(str(path), load_external_data=False)
