"""The format-independent ``trtkv`` ONNX functions: slot validity from the pool's validity words, and masked
GQA attention with the log-sum-exp the runtime merges partial attentions by.

Written with onnxscript, so each is a FunctionProto whose body is standard ONNX (opset 18 ops, rebased on
the exported model's opset when attached). The per-format functions (``format_functions.py``) call these.
"""
from __future__ import annotations

import math

import onnxscript
from onnxscript import BOOL, FLOAT, INT32, INT64
from onnxscript import opset18 as op

TRTKV = onnxscript.values.Opset("trtkv", 1)
NEG_INF = -math.inf
TINY = 1e-30
POW2 = [1 << s for s in range(31)]  # validity words are int32 bit masks of at most 31 slots


@onnxscript.script(TRTKV, default_opset=op)
def SlotLive(valid: INT32, block_table: INT32, block_size: INT64) -> BOOL:
    """``[b, P*B]``: slot s of page ``block_table[b, p]`` is live iff bit s of ``valid[page]`` is set; -1 pads.

    ``block_size`` is a 1-element tensor (the pool's dim 1), so one body serves every page size."""
    pages = op.Cast(op.Max(block_table, op.CastLike(0, block_table)), to=7)
    words = op.Where(op.GreaterOrEqual(block_table, op.CastLike(0, block_table)), op.Gather(valid, pages, axis=0),
                     op.CastLike(0, valid))
    pow2 = op.Slice(op.Constant(value_ints=POW2), [0], op.Cast(block_size, to=7))
    bits = op.Mod(op.Div(op.Unsqueeze(op.Cast(words, to=7), [-1]), pow2), op.Constant(value_int=2))
    live = op.Reshape(op.Equal(bits, op.Constant(value_int=1)), op.Concat(op.Shape(block_table, start=0, end=1),
                                                                           [-1], axis=0))
    return live


@onnxscript.script(TRTKV, default_opset=op)
def MaskedAttention(q: FLOAT, k: FLOAT, v: FLOAT, live: BOOL, sm_scale: float) -> tuple[FLOAT, FLOAT, FLOAT]:
    """One query token per sequence over ``n`` keys: ``q [b, Hq, D]``, ``k, v [b, n, H, D]``, ``live [b, n]``.

    Query heads ``h*G .. h*G+G-1`` share KV head ``h``. Returns ``out [b, Hq, D]`` (0 where nothing is live),
    ``lse [b, Hq]`` (-inf where nothing is live) and the scaled ``logits [b, Hq, n]`` (-inf at dead slots)."""
    qs = op.Shape(q)
    heads = op.Shape(k, start=2, end=3)
    bq = op.Shape(q, start=0, end=2)
    qg = op.Reshape(q, op.Concat(op.Shape(q, start=0, end=1), heads, [-1], op.Shape(q, start=2, end=3), axis=0))
    scaled = op.Mul(op.MatMul(qg, op.Transpose(k, perm=[0, 2, 3, 1])), op.CastLike(sm_scale, q))  # [b, H, G, n]
    masked = op.Where(op.Unsqueeze(live, [1, 2]), scaled, op.CastLike(NEG_INF, q))
    m = op.ReduceMax(masked, [-1], keepdims=1)
    m = op.Where(op.IsInf(m), op.CastLike(0.0, m), m)  # a row with nothing live: exp(-inf) = 0 below
    p = op.Exp(op.Sub(masked, m))
    s = op.ReduceSum(p, [-1], keepdims=1)
    weighted = op.Div(op.MatMul(p, op.Transpose(v, perm=[0, 2, 1, 3])), op.Max(s, op.CastLike(TINY, s)))
    out = op.Reshape(weighted, qs)
    lse = op.Reshape(op.Add(op.Log(s), m), bq)
    logits = op.Reshape(masked, op.Concat(bq, [-1], axis=0))
    return out, lse, logits


SHARED_FUNCTIONS = (SlotLive, MaskedAttention)
