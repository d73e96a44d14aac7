"""The per-format ``trtkv`` ONNX functions: ``KVEncode_<fmt>``, ``KVDecode_<fmt>``, ``PagedAttention_<fmt>``.

Each mirrors the torch reference of ``plugins/formats`` step for step (same fp32 operations in the same
order), so ONNX Runtime stores the same codes the ``kv_write`` plugin would and reads them back to the same
values. Byte-wise decoding goes through tables built from the formats' own decoders; E4M3 scale encoding
(rounding up) counts the representable values below the ratio, E2M1 counts the rounding midpoints (ties to
even), so no bit manipulation is needed and any ONNX runtime can execute the bodies.

Functions are built per format by the factories below (one onnxscript function per format, renamed), and
``format_functions(name)`` returns them; a format without one raises one ``TrtkvError`` line.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import onnx
import onnxscript
import torch
from onnxscript import BOOL, FLOAT, INT16, INT32, UINT8
from onnxscript import opset18 as op

from plugins.formats import get_format
from plugins.formats.blockscaled import BlockScaledFormat
from plugins.formats.e4m3 import e4m3_decode
from plugins.formats.floating import FloatFormat
from plugins.formats.fp8 import FP8Format
from plugins.formats.intq import IntFormat
from plugins.formats.lut import _byte_table, identity_codes
from trtkv.errors import TrtkvError
from trtkv.export.attention_functions import TRTKV, MaskedAttention, SlotLive

POS_INF = math.inf
NEG_INF = -math.inf
NAN = math.nan
_ONNX_FLOAT = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
               torch.bfloat16: onnx.TensorProto.BFLOAT16}


def _tensor(a: np.ndarray, name: str) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.ascontiguousarray(a), name)


E4M3_TABLE = _tensor(e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8)).numpy(), "e4m3")
# values of the bit patterns 0x00..0x7E (0 .. 448), strictly increasing: the code of the smallest value >= x
# is the number of table values below x, which is E4M3 encoding with the magnitude rounded up
E4M3_UP = _tensor(e4m3_decode(torch.arange(127, dtype=torch.int32).to(torch.uint8)).numpy(), "e4m3_up")
E2M1_GT = _tensor(np.array([0.25, 1.25, 2.5, 5.0], np.float32), "gt")  # midpoints whose tie rounds down (even)
E2M1_GE = _tensor(np.array([0.75, 1.75, 3.5], np.float32), "ge")  # midpoints whose tie rounds up (to even)
ONES16 = _tensor(np.ones(16, np.float32), "ones")  # broadcasts a value-group scale over its 16 channels exactly
# E4M3 round-to-nearest-even (FP8 elements): the midpoints between neighbouring magnitudes 0x00..0x7E; a tie goes
# to the even code (mantissa bit 0), so the midpoint above an even code rounds down (>) and above an odd one up (>=)
_E4M3_VALUES = e4m3_decode(torch.arange(127, dtype=torch.int32).to(torch.uint8)).numpy().astype(np.float64)
_E4M3_MIDS = ((_E4M3_VALUES[:-1] + _E4M3_VALUES[1:]) / 2).astype(np.float32)  # exact: 5 significant bits at most
E4M3_MID_GT = _tensor(_E4M3_MIDS[0::2], "mid_gt")
E4M3_MID_GE = _tensor(_E4M3_MIDS[1::2], "mid_ge")
# bfloat16 bit patterns (int16 at the graph boundary: numpy and ONNX Runtime's Python API have no bfloat16).
# BF16_BINADES[i] = 2**(i - 126): the number of them <= |x| is the biased exponent c of a normal |x| (0: subnormal);
# BF16_TO_UNIT[c] scales |x| into [1, 2) (normal) or [0, 1) in units of 2**-126 (subnormal) exactly
BF16_BINADES = _tensor(np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32), "binades")
BF16_TO_UNIT = _tensor(np.ldexp(np.float32(1), np.array([126] + [127 - c for c in range(1, 255)])).astype(np.float32),
                       "to_unit")
# value of the exponent field E for a mantissa integer m (E = 0: m; else 128 + m): 2**(max(E, 1) - 134)
BF16_FIELD_SCALE = _tensor(np.ldexp(np.float32(1), np.maximum(np.arange(256), 1) - 134).astype(np.float32),
                           "field_scale")


@onnxscript.script(TRTKV, default_opset=op)
def E4M3EncodeUp(x: FLOAT) -> UINT8:
    """E4M3 bits of ``x >= 0``, magnitude rounded up, saturating at 448 (block scales never clip elements)."""
    a = op.Min(x, op.CastLike(448.0, x))
    below = op.Less(op.Constant(value=E4M3_UP), op.Unsqueeze(a, [-1]))
    return op.Cast(op.ReduceSum(op.Cast(below, to=6), [-1], keepdims=0), to=2)


@onnxscript.script(TRTKV, default_opset=op)
def E2M1Encode(r: FLOAT) -> INT32:
    """NVFP4 element nibbles: round-to-nearest-even onto E2M1, saturating at 6; bit 3 is r's sign bit."""
    a = op.Unsqueeze(op.Min(op.Abs(r), op.CastLike(6.0, r)), [-1])
    code = op.Add(op.ReduceSum(op.Cast(op.Greater(a, op.Constant(value=E2M1_GT)), to=6), [-1],
                               keepdims=0),
                  op.ReduceSum(op.Cast(op.GreaterOrEqual(a, op.Constant(value=E2M1_GE)), to=6),
                               [-1], keepdims=0))
    zero = op.CastLike(0.0, r)
    negative = op.Or(op.Less(r, zero), op.And(op.Equal(r, zero), op.Less(op.Reciprocal(r), zero)))  # -0.0 too
    return op.Add(code, op.Mul(op.Cast(negative, to=6), op.CastLike(8, code)))


@onnxscript.script(TRTKV, default_opset=op)
def E4M3EncodeNearest(x: FLOAT) -> UINT8:
    """FP8 E4M3 bits of ``x``: round-to-nearest-even, saturating at 448, NaN stored as 0; the sign bit is x's."""
    a = op.Min(op.Abs(x), op.CastLike(448.0, x))
    a = op.Where(op.IsNaN(x), op.CastLike(0.0, x), a)
    u = op.Unsqueeze(a, [-1])
    code = op.Add(op.ReduceSum(op.Cast(op.Greater(u, op.Constant(value=E4M3_MID_GT)), to=6), [-1], keepdims=0),
                  op.ReduceSum(op.Cast(op.GreaterOrEqual(u, op.Constant(value=E4M3_MID_GE)), to=6), [-1],
                               keepdims=0))
    zero = op.CastLike(0.0, x)
    negative = op.Or(op.Less(x, zero), op.And(op.Equal(x, zero), op.Less(op.Reciprocal(x), zero)))
    return op.Cast(op.Add(code, op.Mul(op.Cast(negative, to=6), op.CastLike(128, code))), to=2)


@onnxscript.script(TRTKV, default_opset=op)
def Bf16Encode(x: FLOAT) -> INT16:
    """bfloat16 bit patterns of ``x`` (round to nearest even, as ``Tensor.to(torch.bfloat16)``) as int16:
    the biased exponent by counting binades, the significand rounded in units of its last place."""
    a = op.Abs(x)
    c = op.ReduceSum(op.Cast(op.LessOrEqual(op.Constant(value=BF16_BINADES), op.Unsqueeze(a, [-1])), to=7), [-1],
                     keepdims=0)
    m = op.Round(op.Mul(op.Mul(a, op.Gather(op.Constant(value=BF16_TO_UNIT), c, axis=0)), op.CastLike(128.0, a)))
    # exponent field max(c - 1, 0) and significand m in [128, 256] (a carry into the next binade adds itself)
    mag = op.Add(op.Mul(op.Max(op.Sub(c, op.CastLike(1, c)), op.CastLike(0, c)), op.CastLike(128, c)),
                 op.Cast(op.Where(op.IsInf(a), op.CastLike(0.0, a), m), to=7))
    mag = op.Where(op.IsInf(a), op.CastLike(32640, mag), mag)  # 0x7F80
    zero = op.CastLike(0.0, x)
    negative = op.Or(op.Less(x, zero), op.And(op.Equal(x, zero), op.Less(op.Reciprocal(x), zero)))
    signed = op.Where(negative, op.Sub(mag, op.CastLike(32768, mag)), mag)  # the int16 of bit 15 | mag
    return op.Cast(op.Where(op.IsNaN(x), op.CastLike(32704, signed), signed), to=5)  # NaN: 0x7FC0


@onnxscript.script(TRTKV, default_opset=op)
def Bf16Decode(bits: INT16) -> FLOAT:
    """fp32 values of bfloat16 bit patterns held as int16."""
    u = op.Cast(bits, to=6)
    negative = op.Less(u, op.CastLike(0, u))
    mag = op.Where(negative, op.Add(u, op.CastLike(32768, u)), u)
    e = op.Div(mag, op.CastLike(128, mag))
    m = op.Mod(mag, op.CastLike(128, mag))
    significand = op.Where(op.Equal(e, op.CastLike(0, e)), m, op.Add(m, op.CastLike(128, m)))
    val = op.Mul(op.Cast(significand, to=1), op.Gather(op.Constant(value=BF16_FIELD_SCALE), e, axis=0))
    special = op.Equal(e, op.CastLike(255, e))
    val = op.Where(special, op.Where(op.Equal(m, op.CastLike(0, m)), op.CastLike(POS_INF, val),
                                     op.CastLike(NAN, val)), val)
    # the sign by a product (a float Where turns -0.0 into +0.0 in ONNX Runtime)
    return op.Mul(val, op.Where(negative, op.CastLike(-1.0, val), op.CastLike(1.0, val)))


@onnxscript.script(TRTKV, default_opset=op)
def TernaryEncode(r: FLOAT) -> INT32:
    """Ternary crumbs: round half to even, clamp to {-1, 0, 1}; 01 is +1, 11 is -1, 00 is 0."""
    q = op.Clip(op.Round(r), op.CastLike(-1.0, r), op.CastLike(1.0, r))
    zero = op.CastLike(0.0, r)
    return op.Cast(op.Where(op.Greater(q, zero), op.CastLike(1.0, r), op.Where(op.Less(q, zero), op.CastLike(3.0, r),
                                                                             zero)), to=6)


ELEMENT_ENCODERS = {"nvfp4": E2M1Encode, "nvfp4o": E2M1Encode, "ternary": TernaryEncode, "ternaryo": TernaryEncode}


@dataclass(frozen=True)
class FormatFunctions:
    """The ONNX functions of one KV format, and the helper functions their bodies call."""

    format: str
    encode: onnxscript.OnnxFunction
    decode: onnxscript.OnnxFunction
    paged_attention: onnxscript.OnnxFunction
    helpers: tuple[onnxscript.OnnxFunction, ...]

    @property
    def all(self) -> tuple[onnxscript.OnnxFunction, ...]:
        return (*self.helpers, self.decode, self.encode, self.paged_attention)


def _named(fn: onnxscript.OnnxFunction, name: str) -> onnxscript.OnnxFunction:
    """Give a factory-made function its per-format name (before any function that calls it is scripted)."""
    fn.function_ir.name = name
    fn._name = name
    return fn


def _slot_paged_attention(decode: onnxscript.OnnxFunction, name: str) -> onnxscript.OnnxFunction:
    """``PagedAttention_<name>`` of a format whose records are two slot fields (no scales, no arena)."""

    @onnxscript.script(TRTKV, default_opset=op)
    def paged_attention(q: FLOAT, k_pool, v_pool, valid: INT32, block_table: INT32, sm_scale: float,
                        scale_k: float, scale_v: float):
        pages = op.Cast(op.Max(block_table, op.CastLike(0, block_table)), to=7)
        k, v = decode(op.Gather(k_pool, pages, axis=0), op.Gather(v_pool, pages, axis=0), scale_k=scale_k,
                      scale_v=scale_v)  # [b, P, B, H, D]
        flat = op.Concat(op.Shape(k, start=0, end=1), [-1], op.Shape(k, start=3), axis=0)
        live = SlotLive(valid, block_table, op.Shape(k_pool, start=1, end=2))
        out, lse, logits = MaskedAttention(q, op.Reshape(k, flat), op.Reshape(v, flat), live, sm_scale=sm_scale)
        return out, lse, logits

    return _named(paged_attention, f"PagedAttention_{name}")


def _float_functions(fmt: FloatFormat) -> FormatFunctions:
    if fmt.dtype == torch.bfloat16:
        return _bf16_functions(fmt)
    dt = _ONNX_FLOAT[fmt.dtype]

    @onnxscript.script(TRTKV, default_opset=op)
    def encode(k: FLOAT, v: FLOAT, live: BOOL, scale_k: float, scale_v: float):
        """Stored as-is: the cast is the whole encoding."""
        k_record = op.Cast(k, to=dt)
        v_record = op.Cast(v, to=dt)
        return k_record, v_record

    @onnxscript.script(TRTKV, default_opset=op)
    def decode(k_record, v_record, scale_k: float, scale_v: float) -> tuple[FLOAT, FLOAT]:
        k = op.Cast(k_record, to=1)
        v = op.Cast(v_record, to=1)
        return k, v

    decode = _named(decode, f"KVDecode_{fmt.name}")
    return FormatFunctions(fmt.name, _named(encode, f"KVEncode_{fmt.name}"), decode,
                           _slot_paged_attention(decode, fmt.name), (SlotLive, MaskedAttention))


def _bf16_functions(fmt: FloatFormat) -> FormatFunctions:
    """bfloat16 stored as-is; its records cross the graph boundary as int16 bit patterns (layout.py)."""

    @onnxscript.script(TRTKV, default_opset=op)
    def encode(k: FLOAT, v: FLOAT, live: BOOL, scale_k: float, scale_v: float):
        """The bfloat16 rounding of ``k, v`` (nearest even), as bit patterns."""
        k_record = Bf16Encode(k)
        v_record = Bf16Encode(v)
        return k_record, v_record

    @onnxscript.script(TRTKV, default_opset=op)
    def decode(k_record: INT16, v_record: INT16, scale_k: float, scale_v: float) -> tuple[FLOAT, FLOAT]:
        k = Bf16Decode(k_record)
        v = Bf16Decode(v_record)
        return k, v

    decode = _named(decode, f"KVDecode_{fmt.name}")
    return FormatFunctions(fmt.name, _named(encode, f"KVEncode_{fmt.name}"), decode,
                           _slot_paged_attention(decode, fmt.name), (SlotLive, MaskedAttention, Bf16Encode,
                                                                     Bf16Decode))


def _fp8_functions(fmt: FP8Format) -> FormatFunctions:
    """FP8 E4M3 with the static per-(layer, K|V) tensor scale: ``code = E4M3_RNE(x / scale)``,
    ``x_hat = e4m3(code) * scale`` (plugins/formats/fp8.py); write-through."""

    @onnxscript.script(TRTKV, default_opset=op)
    def encode(k: FLOAT, v: FLOAT, live: BOOL, scale_k: float, scale_v: float):
        """E4M3 codes of ``k / scale_k`` and ``v / scale_v`` (nearest even, saturating at 448)."""
        k_record = E4M3EncodeNearest(op.Div(k, op.CastLike(scale_k, k)))
        v_record = E4M3EncodeNearest(op.Div(v, op.CastLike(scale_v, v)))
        return k_record, v_record

    @onnxscript.script(TRTKV, default_opset=op)
    def decode(k_record: UINT8, v_record: UINT8, scale_k: float, scale_v: float) -> tuple[FLOAT, FLOAT]:
        table = op.Constant(value=E4M3_TABLE)
        kd = op.Gather(table, op.Cast(k_record, to=7), axis=0)
        vd = op.Gather(table, op.Cast(v_record, to=7), axis=0)
        k = op.Mul(kd, op.CastLike(scale_k, kd))
        v = op.Mul(vd, op.CastLike(scale_v, vd))
        return k, v

    decode = _named(decode, f"KVDecode_{fmt.name}")
    return FormatFunctions(fmt.name, _named(encode, f"KVEncode_{fmt.name}"), decode,
                           _slot_paged_attention(decode, fmt.name), (SlotLive, MaskedAttention, E4M3EncodeNearest))


def _packers(bits: int, elem_table: onnx.TensorProto, name: str):
    """``Pack<bits>`` (codes -> bytes, element j of a byte at bit ``bits * j``) and ``Unpack_<name>`` (bytes ->
    the elements' fp32 values through ``elem_table [256, 8 / bits]``)."""
    per = 8 // bits
    shifts = _tensor(np.array([1 << (bits * j) for j in range(per)], np.int32), "shifts")
    per_byte = _tensor(np.array([-1, per], np.int64), "per_byte")

    @onnxscript.script(TRTKV, default_opset=op)
    def pack(codes: INT32) -> UINT8:
        grouped = op.Reshape(codes, op.Concat(op.Shape(codes, start=0, end=-1), op.Constant(value=per_byte), axis=0))
        return op.Cast(op.ReduceSum(op.Mul(grouped, op.Constant(value=shifts)), [-1], keepdims=0), to=2)

    @onnxscript.script(TRTKV, default_opset=op)
    def unpack(codes: UINT8) -> FLOAT:
        values = op.Gather(op.Constant(value=elem_table), op.Cast(codes, to=7), axis=0)
        return op.Reshape(values, op.Concat(op.Shape(codes, start=0, end=-1), [-1], axis=0))

    return _named(pack, f"Pack{bits}"), _named(unpack, f"Unpack_{name}")


def _int_functions(fmt: IntFormat) -> FormatFunctions:
    """KIVI-style asymmetric INT4 / INT2 (plugins/formats/intq.py): fp16 scale and zero, keys per channel over the
    flush group (group records), values per token over 16 channels (slot records)::

        zero = fp16(min)    scale = fp16(min((max - min) / levels, 65504))
        code = clamp(round_half_even((x - zero) / scale), 0, levels)     (0 where scale == 0)
        x_hat = code * scale + zero
    """
    pack, unpack = _packers(fmt.bits, _tensor(_byte_table(identity_codes, fmt.bits, "cpu").numpy(), "elements"),
                            fmt.name)
    levels = float(fmt.levels)

    @onnxscript.script(TRTKV, default_opset=op)
    def codes(x: FLOAT, scale, zero) -> INT32:
        s = op.Cast(scale, to=1)
        ok = op.Greater(s, op.CastLike(0.0, s))
        q = op.Round(op.Div(op.Sub(x, op.Cast(zero, to=1)), op.Where(ok, s, op.CastLike(1.0, s))))
        q = op.Where(ok, op.Clip(q, op.CastLike(0.0, q), op.CastLike(levels, q)), op.CastLike(0.0, q))
        return op.Cast(q, to=6)

    codes = _named(codes, f"IntCodes_{fmt.name}")

    @onnxscript.script(TRTKV, default_opset=op)
    def encode(k: FLOAT, v: FLOAT, live: BOOL, scale_k: float, scale_v: float):
        """One flush group per row: ``k, v [n, g, H, D]``, ``live [n, g]`` (a partial group's dead rows are left
        out of its key statistics)."""
        live4 = op.Unsqueeze(live, [2, 3])
        kmax = op.ReduceMax(op.Where(live4, k, op.CastLike(NEG_INF, k)), [1], keepdims=1)
        kmin = op.ReduceMin(op.Where(live4, k, op.CastLike(POS_INF, k)), [1], keepdims=1)
        big = op.CastLike(65504.0, k)
        k_scale = op.Cast(op.Min(op.Div(op.Sub(kmax, kmin), op.CastLike(levels, k)), big), to=10)
        k_zero = op.Cast(op.Clip(kmin, op.Neg(big), big), to=10)
        vgroups = op.Reshape(v, op.Concat(op.Shape(v, start=0, end=-1), [-1, 16], axis=0))
        vmax = op.ReduceMax(vgroups, [-1], keepdims=0)
        vmin = op.ReduceMin(vgroups, [-1], keepdims=0)
        v_scale_record = op.Cast(op.Min(op.Div(op.Sub(vmax, vmin), op.CastLike(levels, v)), big), to=10)
        v_zero_record = op.Cast(op.Clip(vmin, op.Neg(big), big), to=10)
        sv = op.Reshape(op.Mul(op.Unsqueeze(op.Cast(v_scale_record, to=1), [-1]), op.Constant(value=ONES16)),
                        op.Shape(v))
        zv = op.Reshape(op.Mul(op.Unsqueeze(op.Cast(v_zero_record, to=1), [-1]), op.Constant(value=ONES16)),
                        op.Shape(v))
        k_record = pack(codes(k, k_scale, k_zero))
        v_record = pack(codes(v, sv, zv))
        k_scale_record = op.Squeeze(k_scale, [1])
        k_zero_record = op.Squeeze(k_zero, [1])
        return k_record, v_record, v_scale_record, v_zero_record, k_scale_record, k_zero_record

    @onnxscript.script(TRTKV, default_opset=op)
    def decode(k_record: UINT8, v_record: UINT8, v_scale_record, v_zero_record, k_scale_record, k_zero_record,
               scale_k: float, scale_v: float) -> tuple[FLOAT, FLOAT]:
        """Slot records ``[..., *shape]`` with their group records gathered per slot."""
        kc = unpack(k_record)
        vc = unpack(v_record)
        k = op.Add(op.Mul(kc, op.Cast(k_scale_record, to=1)), op.Cast(k_zero_record, to=1))
        sv = op.Reshape(op.Mul(op.Unsqueeze(op.Cast(v_scale_record, to=1), [-1]), op.Constant(value=ONES16)),
                        op.Shape(vc))
        zv = op.Reshape(op.Mul(op.Unsqueeze(op.Cast(v_zero_record, to=1), [-1]), op.Constant(value=ONES16)),
                        op.Shape(vc))
        v = op.Add(op.Mul(vc, sv), zv)
        return k, v

    decode = _named(decode, f"KVDecode_{fmt.name}")

    @onnxscript.script(TRTKV, default_opset=op)
    def paged_attention(q: FLOAT, k_pool: UINT8, v_pool: UINT8, v_scale_pool, v_zero_pool, k_scale_arena,
                        k_zero_arena, k_group: INT32, valid: INT32, block_table: INT32, sm_scale: float,
                        scale_k: float, scale_v: float):
        pages = op.Cast(op.Max(block_table, op.CastLike(0, block_table)), to=7)
        gid = op.Cast(op.Max(op.Gather(k_group, pages, axis=0), op.CastLike(0, k_group)), to=7)
        k, v = decode(op.Gather(k_pool, pages, axis=0), op.Gather(v_pool, pages, axis=0),
                      op.Gather(v_scale_pool, pages, axis=0), op.Gather(v_zero_pool, pages, axis=0),
                      op.Gather(k_scale_arena, gid, axis=0), op.Gather(k_zero_arena, gid, axis=0),
                      scale_k=scale_k, scale_v=scale_v)
        flat = op.Concat(op.Shape(k, start=0, end=1), [-1], op.Shape(k, start=3), axis=0)
        live = SlotLive(valid, block_table, op.Shape(k_pool, start=1, end=2))
        out, lse, logits = MaskedAttention(q, op.Reshape(k, flat), op.Reshape(v, flat), live, sm_scale=sm_scale)
        return out, lse, logits

    return FormatFunctions(fmt.name, _named(encode, f"KVEncode_{fmt.name}"), decode,
                           _named(paged_attention, f"PagedAttention_{fmt.name}"),
                           (SlotLive, MaskedAttention, codes, pack, unpack))


def _blockscaled_functions(fmt: BlockScaledFormat) -> FormatFunctions:
    """NVFP4 / ternary and their key-offset variants (plugins/formats/blockscaled.py)."""
    elem_table = _tensor(_byte_table(fmt.element_decode, fmt.code_bits, "cpu").numpy(), "elements")
    pack, unpack = _packers(fmt.code_bits, elem_table, fmt.name)
    qmax = float(fmt.qmax)
    element_encode = ELEMENT_ENCODERS[fmt.name]

    @onnxscript.script(TRTKV, default_opset=op)
    def quantize(k: FLOAT, v: FLOAT, live: BOOL, scale_k: float, scale_v: float):
        """``k, v [n, g, H, D]`` -> codes, value scales ``[n, g, H, D/16]``, key scales ``[n, H, D]``."""
        gk = op.CastLike(scale_k, k)
        gv = op.CastLike(scale_v, v)
        live4 = op.Unsqueeze(live, [2, 3])
        rk = op.Div(op.ReduceMax(op.Where(live4, op.Abs(k), op.CastLike(0.0, k)), [1], keepdims=1),
                    op.Mul(op.CastLike(qmax, k), gk))
        vgroups = op.Reshape(v, op.Concat(op.Shape(v, start=0, end=-1), [-1, 16], axis=0))
        rv = op.Div(op.ReduceMax(op.Abs(vgroups), [-1], keepdims=0), op.Mul(op.CastLike(qmax, v), gv))
        k_scale = E4M3EncodeUp(rk)
        v_scale = E4M3EncodeUp(rv)
        sk = op.Mul(op.Gather(op.Constant(value=E4M3_TABLE), op.Cast(k_scale, to=7), axis=0), gk)
        sv = op.Mul(op.Gather(op.Constant(value=E4M3_TABLE), op.Cast(v_scale, to=7), axis=0), gv)
        sv = op.Reshape(op.Mul(op.Unsqueeze(sv, [-1]), op.Constant(value=ONES16)), op.Shape(v))
        # a group whose scale is 0 stores code 0; the select happens on the codes, because a float Where
        # turns -0.0 into +0.0 in ONNX Runtime and E2M1 keeps the sign bit of x / s (torch.signbit)
        zero = op.CastLike(0.0, k)
        one = op.CastLike(1.0, k)
        k_ok = op.Greater(sk, zero)
        v_ok = op.Greater(sv, zero)
        kc = element_encode(op.Div(k, op.Where(k_ok, sk, one)))
        vc = element_encode(op.Div(v, op.Where(v_ok, sv, one)))
        k_record = pack(op.Where(k_ok, kc, op.CastLike(0, kc)))
        v_record = pack(op.Where(v_ok, vc, op.CastLike(0, vc)))
        v_scale_record = op.Identity(v_scale)
        k_scale_record = op.Squeeze(k_scale, [1])
        return k_record, v_record, v_scale_record, k_scale_record

    quantize = _named(quantize, f"BlockQuantize_{fmt.name}")

    @onnxscript.script(TRTKV, default_opset=op)
    def dequantize(k_record: UINT8, v_record: UINT8, v_scale_record: UINT8, k_scale_record: UINT8, scale_k: float,
                   scale_v: float) -> tuple[FLOAT, FLOAT]:
        kc = unpack(k_record)
        vc = unpack(v_record)
        k_scale = k_scale_record
        v_scale = v_scale_record
        table = op.Constant(value=E4M3_TABLE)
        kd = op.Mul(op.Mul(kc, op.Gather(table, op.Cast(k_scale, to=7), axis=0)), op.CastLike(scale_k, kc))
        sv = op.Gather(table, op.Cast(v_scale, to=7), axis=0)
        sv = op.Reshape(op.Mul(op.Unsqueeze(sv, [-1]), op.Constant(value=ONES16)), op.Shape(vc))
        k = op.Identity(kd)
        v = op.Mul(op.Mul(vc, sv), op.CastLike(scale_v, vc))
        return k, v

    dequantize = _named(dequantize, f"BlockDequantize_{fmt.name}")
    helpers = (SlotLive, MaskedAttention, E4M3EncodeUp, element_encode, pack, unpack, quantize, dequantize)

    if fmt.key_offset:  # a per-channel fp16 key midpoint, subtracted before quantizing, in the group record
        @onnxscript.script(TRTKV, default_opset=op)
        def encode(k: FLOAT, v: FLOAT, live: BOOL, scale_k: float, scale_v: float):
            """One flush group per row: ``k, v [n, g, H, D]``, ``live [n, g]`` (a partial group's dead rows
            are left out of its key statistics)."""
            live4 = op.Unsqueeze(live, [2, 3])
            kmax = op.ReduceMax(op.Where(live4, k, op.CastLike(NEG_INF, k)), [1], keepdims=1)
            kmin = op.ReduceMin(op.Where(live4, k, op.CastLike(POS_INF, k)), [1], keepdims=1)
            offset = op.Cast(op.Div(op.Add(kmax, kmin), op.CastLike(2.0, k)), to=10)
            k_record, v_record, v_scale_record, k_scale_record = quantize(op.Sub(k, op.Cast(offset, to=1)), v, live,
                                                                          scale_k=scale_k, scale_v=scale_v)
            k_offset_record = op.Squeeze(offset, [1])
            return k_record, v_record, v_scale_record, k_scale_record, k_offset_record

        @onnxscript.script(TRTKV, default_opset=op)
        def decode(k_record: UINT8, v_record: UINT8, v_scale_record: UINT8, k_scale_record: UINT8, k_offset_record,
                   scale_k: float, scale_v: float) -> tuple[FLOAT, FLOAT]:
            """Slot records ``[..., *shape]`` with their group records gathered per slot."""
            kd, v = dequantize(k_record, v_record, v_scale_record, k_scale_record, scale_k=scale_k, scale_v=scale_v)
            k = op.Add(kd, op.Cast(k_offset_record, to=1))
            return k, v

        decode = _named(decode, f"KVDecode_{fmt.name}")

        @onnxscript.script(TRTKV, default_opset=op)
        def paged_attention(q: FLOAT, k_pool: UINT8, v_pool: UINT8, v_scale_pool: UINT8, k_scale_arena: UINT8,
                            k_offset_arena, k_group: INT32, valid: INT32, block_table: INT32, sm_scale: float,
                            scale_k: float, scale_v: float):
            pages = op.Cast(op.Max(block_table, op.CastLike(0, block_table)), to=7)
            gid = op.Cast(op.Max(op.Gather(k_group, pages, axis=0), op.CastLike(0, k_group)), to=7)
            k, v = decode(op.Gather(k_pool, pages, axis=0), op.Gather(v_pool, pages, axis=0),
                          op.Gather(v_scale_pool, pages, axis=0), op.Gather(k_scale_arena, gid, axis=0),
                          op.Gather(k_offset_arena, gid, axis=0), scale_k=scale_k, scale_v=scale_v)
            flat = op.Concat(op.Shape(k, start=0, end=1), [-1], op.Shape(k, start=3), axis=0)
            live = SlotLive(valid, block_table, op.Shape(k_pool, start=1, end=2))
            out, lse, logits = MaskedAttention(q, op.Reshape(k, flat), op.Reshape(v, flat), live, sm_scale=sm_scale)
            return out, lse, logits
    else:
        @onnxscript.script(TRTKV, default_opset=op)
        def encode(k: FLOAT, v: FLOAT, live: BOOL, scale_k: float, scale_v: float):
            """One flush group per row: ``k, v [n, g, H, D]``, ``live [n, g]`` (a partial group's dead rows
            are left out of its key statistics). Keys per channel over the group, values per token."""
            k_record, v_record, v_scale_record, k_scale_record = quantize(k, v, live, scale_k=scale_k,
                                                                          scale_v=scale_v)
            return k_record, v_record, v_scale_record, k_scale_record

        @onnxscript.script(TRTKV, default_opset=op)
        def decode(k_record: UINT8, v_record: UINT8, v_scale_record: UINT8, k_scale_record: UINT8, scale_k: float,
                   scale_v: float) -> tuple[FLOAT, FLOAT]:
            """Slot records ``[..., *shape]`` with their group records gathered per slot."""
            k, v = dequantize(k_record, v_record, v_scale_record, k_scale_record, scale_k=scale_k, scale_v=scale_v)
            return k, v

        decode = _named(decode, f"KVDecode_{fmt.name}")

        @onnxscript.script(TRTKV, default_opset=op)
        def paged_attention(q: FLOAT, k_pool: UINT8, v_pool: UINT8, v_scale_pool: UINT8, k_scale_arena: UINT8,
                            k_group: INT32, valid: INT32, block_table: INT32, sm_scale: float, scale_k: float,
                            scale_v: float):
            pages = op.Cast(op.Max(block_table, op.CastLike(0, block_table)), to=7)
            gid = op.Cast(op.Max(op.Gather(k_group, pages, axis=0), op.CastLike(0, k_group)), to=7)
            k, v = decode(op.Gather(k_pool, pages, axis=0), op.Gather(v_pool, pages, axis=0),
                          op.Gather(v_scale_pool, pages, axis=0), op.Gather(k_scale_arena, gid, axis=0),
                          scale_k=scale_k, scale_v=scale_v)
            flat = op.Concat(op.Shape(k, start=0, end=1), [-1], op.Shape(k, start=3), axis=0)
            live = SlotLive(valid, block_table, op.Shape(k_pool, start=1, end=2))
            out, lse, logits = MaskedAttention(q, op.Reshape(k, flat), op.Reshape(v, flat), live, sm_scale=sm_scale)
            return out, lse, logits

    return FormatFunctions(fmt.name, _named(encode, f"KVEncode_{fmt.name}"), decode,
                           _named(paged_attention, f"PagedAttention_{fmt.name}"), helpers)


EXPORTABLE_FORMATS = ("fp32", "fp16", "bf16", "fp8", "nvfp4", "nvfp4o", "ternary", "ternaryo", "int4", "int2")


@functools.cache
def format_functions(name: str) -> FormatFunctions:
    """The ONNX functions of KV format ``name``; one ``TrtkvError`` line for a format without them."""
    if name not in EXPORTABLE_FORMATS:
        raise TrtkvError(f"KV format {name!r} has no ONNX functions yet; exportable formats: "
                         f"{', '.join(EXPORTABLE_FORMATS)}")
    fmt = get_format(name)
    if isinstance(fmt, FloatFormat):
        return _float_functions(fmt)
    if isinstance(fmt, FP8Format):
        return _fp8_functions(fmt)
    if isinstance(fmt, IntFormat):
        return _int_functions(fmt)
    return _blockscaled_functions(fmt)
