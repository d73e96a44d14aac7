"""``trtkv export --check``: Polygraphy compares the exported graphs run by ONNX Runtime against the PyTorch
engine's own logits on recorded steps.

The PyTorch runtime generates greedily and its logits (prefill and every decode step) are the reference. The
ONNX Runtime engine then replays the same tokens (teacher forcing), and the graph inputs of each step are
recorded. Polygraphy's ``OnnxrtRunner`` runs ``prefill.onnx`` and ``decode_step.onnx`` on those inputs, the
torch logits are loaded as a second runner's results, and ``Comparator.compare_accuracy`` reports the max
absolute and relative error per output (``logits``) over all steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtkv.runtime.observers import EngineObserver
from trtkv.runtime.sampling import SamplingParams
from trtkv.runtime.scheduler import Scheduler

CHECK_PROMPTS = ("Explain why the sky is blue, step by step.",
                 "Write a short story about a robot learning to paint.")
# Logits tolerances the check passes at (an element passes within atol OR rtol). fp32 weights: ONNX Runtime and
# PyTorch differ by float rounding only, which 4-bit KV codes occasionally amplify (a code flips at a midpoint).
DEFAULT_ATOL = 1e-2
DEFAULT_RTOL = 1e-2


@dataclass
class GraphCheck:
    graph: str
    output: str
    steps: int
    max_abs: float
    max_rel: float
    passed: bool

    def line(self, atol: float, rtol: float) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{self.graph:<17} {self.output:<7} {self.steps:>3} steps  max abs {self.max_abs:.3e}  "
                f"max rel {self.max_rel:.3e}  {verdict} (atol {atol:g} or rtol {rtol:g})")


class _LogitsRecorder(EngineObserver):
    def __init__(self):
        self.prefill: list[np.ndarray] = []
        self.decode: list[np.ndarray] = []

    def on_prefill(self, req, logits, stats) -> None:
        self.prefill.append(logits.float().numpy().copy())

    def on_decode(self, reqs, logits, stats) -> None:
        self.decode.append(logits.float().numpy().copy())


def _generate(engine, prompt: str, params: SamplingParams, observer, forced=None) -> list[int]:
    core = engine.make_core(observers=[observer])
    scheduler = Scheduler(core, 1)
    req = engine.make_request(prompt, params)
    req.forced_tokens = forced
    scheduler.add(req)
    while scheduler.has_work:
        scheduler.step()
    return req.result.token_ids


def record_steps(torch_engine, ort_engine, prompts=CHECK_PROMPTS, steps: int = 16):
    """Graph feeds of every step the ONNX Runtime engine ran, and the torch engine's logits for them."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    sessions = ort_engine._sessions
    feeds: dict[str, list[dict]] = {"prefill": [], "decode_step": []}
    reference: dict[str, list[np.ndarray]] = {"prefill": [], "decode_step": []}
    run_prefill, run_decode = sessions.run_prefill, sessions.run_decode

    def prefill(ids):
        feeds["prefill"].append({"input_ids": np.asarray(ids, np.int64)})
        return run_prefill(ids)

    def decode(f, outputs):
        feeds["decode_step"].append({k: np.array(v, copy=True) for k, v in f.items()})
        return run_decode(f, outputs)

    sessions.run_prefill, sessions.run_decode = prefill, decode
    try:
        for prompt in prompts:
            rec = _LogitsRecorder()
            tokens = _generate(torch_engine, prompt, params, rec)
            reference["prefill"] += rec.prefill
            reference["decode_step"] += rec.decode
            _generate(ort_engine, prompt, params, EngineObserver(), forced=tokens)
    finally:
        sessions.run_prefill, sessions.run_decode = run_prefill, run_decode
    return feeds, reference


def polygraphy_check(export_dir, feeds, reference, atol: float = DEFAULT_ATOL,
                     rtol: float = DEFAULT_RTOL) -> list[GraphCheck]:
    """Run each graph on its recorded feeds with Polygraphy's ONNX Runtime runner; compare ``logits``."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    try:  # polygraphy >= 0.50; CompareFunc.simple before
        from polygraphy.comparator import SimpleCompareFunc as simple_compare
    except ImportError:
        from polygraphy.comparator import CompareFunc

        simple_compare = CompareFunc.simple

    G_LOGGER.module_severity = G_LOGGER.ERROR
    out = []
    for graph in ("prefill", "decode_step"):
        runner = OnnxrtRunner(SessionFromOnnx(str(export_dir / f"{graph}.onnx"), providers=["cpu"]),
                              name=f"onnxrt:{graph}")
        results = Comparator.run([runner], data_loader=feeds[graph])
        results.add([{"logits": r} for r in reference[graph]], runner_name=f"torch:{graph}")  # the reference
        accuracy = Comparator.compare_accuracy(results, compare_func=simple_compare(atol=atol, rtol=rtol))
        max_abs = max_rel = 0.0
        passed = bool(accuracy)
        for acc in accuracy:  # one AccuracyResult per compare function: runner pair -> per-iteration results
            for iterations in acc.values():
                for it in iterations:
                    r = it["logits"]
                    max_abs, max_rel = max(max_abs, r.max_absdiff), max(max_rel, r.max_reldiff)
        out.append(GraphCheck(f"{graph}.onnx", "logits", len(feeds[graph]), max_abs, max_rel, passed))
    return out


def run_check(engine_path, export_dir, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, steps: int = 16,
              log=print) -> list[GraphCheck]:
    """Load the engine with both runtimes, record, compare; returns one result per graph."""
    from pathlib import Path

    from trtkv.api import Engine

    torch.manual_seed(0)
    torch_engine = Engine.load(engine_path)
    ort_engine = Engine.load(engine_path, runtime="onnxruntime", onnx_dir=export_dir)
    feeds, reference = record_steps(torch_engine, ort_engine, steps=steps)
    checks = polygraphy_check(Path(export_dir), feeds, reference, atol, rtol)
    for c in checks:
        log(c.line(atol, rtol))
    return checks
