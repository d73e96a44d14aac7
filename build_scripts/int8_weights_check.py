"""int8 weights: one product of each SmolLM2 projection shape at decode row counts, trtkv's ``int8_linear``
against fp32 (oneDNN-packed, what ``--weights dense`` runs) and the int8 kernels of the libraries (torch's
``_weight_int8pack_mm``, torch's FBGEMM dynamic-quantized linear, torchao's int8 configs when installed); then,
given two engines of one model (dense and ``--weights int8``), the teacher-forced fidelity over the traces.

    python build_scripts/int8_weights_check.py [--dense ENGINE --int8 ENGINE [--tokens 1024]]
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from plugins import ops
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
    print("N x K | M | fp32 oneDNN | trtkv int8 | torch int8pack_mm | torch FBGEMM dynamic | torchao wo | torchao dyn")
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        quantize_ = None
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        scales = w.abs().amax(1) / 127
        codes = (w / scales[:, None]).round().to(torch.int8)
        packed = Int8Weight.pack(codes, scales)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        qw = torch.quantize_per_channel(w, scales.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        fbgemm = torch.ops.quantized.linear_prepack(qw, None)
        for m in rows:
            x = torch.randn(m, k)
            cells = [us(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")),
                     us(lambda: ops.int8_linear(x, packed.codes_b, packed.scales)),
                     us(lambda: torch.ops.aten._weight_int8pack_mm(x, codes, scales)),
                     us(lambda: torch.ops.quantized.linear_dynamic(x, fbgemm))]
            for cfg in ((Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()) if quantize_ else ()):
                lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
                lin[0].weight.data.copy_(w)
                quantize_(lin, cfg)
                with torch.no_grad():
                    cells.append(us(lambda: lin(x), 50))
            print(f"{n} x {k} | {m} | " + " | ".join(f"{c:.1f}" for c in cells) + ("" if quantize_ else " | - | -"))


def fidelity(dense_path: str, int8_path: str, tokens: int) -> None:
    from trtkv.api import Engine
    from trtkv.eval.datasets import load_traces
    from trtkv.eval.weights_fidelity import compare_weights

    dense, int8 = Engine.load(dense_path), Engine.load(int8_path)
    traces = load_traces()
    ids = [dense.tokenizer.encode(t.prompt + t.completion)[:tokens] for t in traces]
    print(f"{len(ids)} traces, {sum(map(len, ids))} positions:", compare_weights(dense, int8, ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--dense")
    ap.add_argument("--int8")
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    products([int(r) for r in a.rows.split(",")])
    if a.dense and a.int8:
        fidelity(a.dense, a.int8, a.tokens)


if __name__ == "__main__":
    main()
