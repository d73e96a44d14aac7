"""Export an engine: check that its policy and formats can run from the graphs, build both step graphs, write
``prefill.onnx``, ``decode_step.onnx`` (weights as external data) and ``export.json``."""
from __future__ import annotations

import time
from pathlib import Path

from trtkv.errors import TrtkvError
from trtkv.export.format_functions import EXPORTABLE_FORMATS
from trtkv.export.functions import library
from trtkv.export import DEFAULT_OPSET
from trtkv.export.graph_export import export_graph
from trtkv.export.layout import NUMPY_DTYPE, KVLayout
from trtkv.export.manifest import ExportManifest, FunctionSchema, GraphFile, engine_fingerprint
from trtkv.export.step_graphs import DecodeStep, PrefillStep

# Policies whose hooks only need what the graphs return: the logits, the write records and the decode step's
# attention logits (statistics). Others read prefill statistics, queries or host tiers the graphs do not give.
EXPORTABLE_POLICIES = ("full", "streamingllm", "thinkv", "thinkv-tbq", "thinkv-tbe")


def check_exportable(engine) -> None:
    """One ``TrtkvError`` line when the engine's policy, formats or cache settings cannot run from ONNX."""
    name = engine.manifest.policy.name
    if name not in EXPORTABLE_POLICIES:
        raise TrtkvError(f"policy {name!r} cannot run from the ONNX graphs (it reads state the graphs do not "
                         f"return); exportable policies: {', '.join(EXPORTABLE_POLICIES)}")
    bad = sorted(set(engine.policy.formats()) - set(EXPORTABLE_FORMATS))
    if bad:
        raise TrtkvError(f"KV format {bad[0]!r} has no ONNX functions yet; exportable formats: "
                         f"{', '.join(EXPORTABLE_FORMATS)}")
    if engine.manifest.model.weights != "dense":
        raise TrtkvError(f"{engine.manifest.model.weights} weights do not export to ONNX (dense weights do); export a "
                         "--weights dense build of the same model")
    if engine.cache_cfg.demote != "none":
        raise TrtkvError(f"cache setting demote={engine.cache_cfg.demote} (host tiers) cannot run from the ONNX "
                         "graphs; use demote=none")


def kv_layout(engine) -> KVLayout:
    a, cfg, pol = engine.arch, engine.cache_cfg, engine.policy
    return KVLayout(num_layers=a.num_hidden_layers, num_q_heads=a.num_attention_heads,
                    num_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
                    block_size=cfg.block_size, group=cfg.residual_group, formats=tuple(sorted(pol.formats())),
                    residual_dtype=NUMPY_DTYPE[cfg.residual_dtype],
                    buffers_prompt_tail=cfg.residual_group > 1 and not pol.flush_prompt_tail())


def layer_scales(engine, layout: KVLayout) -> list[list[tuple[float, float]]]:
    cache = engine.core.cache
    return [[(cache.layer_scales(layer, f).k, cache.layer_scales(layer, f).v) for f in layout.formats]
            for layer in range(layout.num_layers)]


def export_engine(engine, out: Path, opset: int = DEFAULT_OPSET, inline: bool = False,
                  log=lambda msg: None) -> ExportManifest:
    """Write the engine's step graphs and ``export.json`` into ``out``."""
    from trtkv.version import __version__

    check_exportable(engine)
    out = Path(out)
    layout = kv_layout(engine)
    scales = layer_scales(engine, layout)
    graphs = {}
    for name, module, inputs, outputs in (
            ("prefill", PrefillStep(engine.model, layout, scales), layout.prefill_inputs(), layout.prefill_outputs()),
            ("decode_step", DecodeStep(engine.model, layout, scales), layout.decode_inputs(),
             layout.decode_outputs())):
        t0 = time.perf_counter()
        export_graph(module, inputs, outputs, out / f"{name}.onnx", layout.formats, layout.vocab_size, layout.group,
                     opset, inline)
        log(f"{name}.onnx written ({len(inputs)} inputs, {len(outputs)} outputs, {time.perf_counter() - t0:.1f} s)")
        graphs[name] = GraphFile(f"{name}.onnx", tuple(inputs), tuple(outputs))
    params = engine.policy.params()
    functions = [FunctionSchema(fn.name, tuple(p.input), tuple(p.output), tuple(p.attribute))
                 for fn in library(layout.formats) for p in [fn.to_function_proto()]]
    manifest = ExportManifest(
        trtkv_version=__version__, engine=str(Path(engine.path).resolve()),
        engine_fingerprint=engine_fingerprint(engine.path, params, opset, inline), model=engine.manifest.model.alias,
        policy=engine.manifest.policy.name, policy_params=params, kv=layout, scales=scales, opset=opset,
        inline=inline, graphs=graphs, functions=functions)
    manifest.write(out)
    return manifest
