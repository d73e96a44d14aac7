"""Quantized weights: one product of each SmolLM2 projection shape at decode row counts, trtkv's ``int8_linear``
and ``int4_linear`` against fp32 (oneDNN-packed, what ``--weights dense`` runs) and the libraries' kernels
(torch's ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``, torch's FBGEMM dynamic-quantized linear,
torchao's int8 configs when installed); then, given a dense engine and quantized engines of the same model, the
teacher-forced fidelity over the traces.

    python build_scripts/quantized_weights_check.py [--dense ENGINE --test ENGINE [--test ENGINE] [--tokens 1024]]
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from plugins import ops
from plugins.int4_linear.reference import Int4Weight
from plugins.int8_linear.reference import Int8Weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate_up, down, head


def us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def products(rows: list[int]) -> None:
    warnings.simplefilter("ignore")
    print(f"threads {torch.get_num_threads()}; us per product (x [M, K] @ w[N, K].T)")
    print("N x K | M | fp32 oneDNN | trtkv int8 | trtkv int4 g32 | torch int8pack_mm | torch int4pack_mm g32 | "
          "torch FBGEMM dynamic | torchao wo | torchao dyn")
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        quantize_ = None
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        scales = w.abs().amax(1) / 127
        codes = (w / scales[:, None]).round().to(torch.int8)
        packed = Int8Weight.pack(codes, scales)
        g = w.view(n, k // 32, 32)
        s4 = g.abs().amax(-1) / 7
        c4 = ((g / s4[..., None]).round().clamp(-8, 7) + 8).to(torch.uint8).view(n, k)
        packed4 = Int4Weight.pack(c4, s4, -8 * s4)
        torch_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c4.int().contiguous(), 1)
        sz = torch.stack([s4.t(), torch.zeros_like(s4.t())], -1).contiguous()
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        qw = torch.quantize_per_channel(w, scales.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        fbgemm = torch.ops.quantized.linear_prepack(qw, None)
        for m in rows:
            x = torch.randn(m, k)
            cells = [us(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")),
                     us(lambda: ops.int8_linear(x, packed.codes_b, packed.scales)),
                     us(lambda: ops.int4_linear(x, packed4)),
                     us(lambda: torch.ops.aten._weight_int8pack_mm(x, codes, scales)),
                     us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_int4, 32, sz)),
                     us(lambda: torch.ops.quantized.linear_dynamic(x, fbgemm))]
            for cfg in ((Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()) if quantize_ else ()):
                lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
                lin[0].weight.data.copy_(w)
                quantize_(lin, cfg)
                with torch.no_grad():
                    cells.append(us(lambda: lin(x), 50))
            print(f"{n} x {k} | {m} | " + " | ".join(f"{c:.1f}" for c in cells) + ("" if quantize_ else " | - | -"))


def fidelity(dense_path: str, test_paths: list[str], tokens: int) -> None:
    from trtkv.api import Engine
    from trtkv.eval.datasets import load_traces
    from trtkv.eval.weights_fidelity import compare_weights

    dense = Engine.load(dense_path)
    traces = load_traces()
    ids = [dense.tokenizer.encode(t.prompt + t.completion)[:tokens] for t in traces]
    for path in test_paths:
        test = Engine.load(path)
        print(f"{path} ({test.manifest.model.weights}): {len(ids)} traces, {sum(map(len, ids))} positions:",
              compare_weights(dense, test, ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--dense")
    ap.add_argument("--test", action="append", default=[])
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    products([int(r) for r in a.rows.split(",")])
    if a.dense and a.test:
        fidelity(a.dense, a.test, a.tokens)


if __name__ == "__main__":
    main()
