"""Registers the plugins as ``torch.ops.trtkv.*`` with schemas, CPU/CUDA kernels and Meta (fake) kernels.

Registered through ``torch.library.Library`` (the C++ dispatcher calls straight into the Python
kernel): ``torch.library.custom_op``'s Python wrapper costs ~0.5 ms per call with mutable list
arguments, which at 30 layers per decoded token would dominate CPU decode. Each op dispatches to its
Triton kernel when ``plugins.backend.use_triton`` says so, to the compiled CPU kernel
(``plugins/cpu_kernels``) on CPU when it built, else to the torch reference beside it.

The eager runtime calls the Python entry points below (``plugins.ops.kv_write`` ...) directly: they
are exactly the kernels registered behind ``torch.ops.trtkv.*``, minus the dispatcher's boxing of the
``Tensor[]`` arguments (~50-80 us per call on CPU). ``torch.ops.trtkv.*`` is the interface for
users, tests, ``torch.compile`` and export.
"""
from __future__ import annotations

import torch

from plugins.backend import kernel_impl, use_cpu_kernels
from plugins.buffer_attention.reference import buffer_attention_ref
from plugins.kmeans_select.reference import kmeans_select_ref
from plugins.kv_write.reference import kv_write_groups_ref, kv_write_ref
from plugins.lowest_victim.reference import lowest_victim_ref
from plugins.table_victims.reference import table_victims_ref
from plugins.scatter_add_rows.reference import finite_rows_ref, fold_add_rows_ref, scatter_add_rows_ref
from plugins.gather_keys.reference import gather_keys_ref
from plugins.gather_rows.reference import gather_rows_ref
from plugins.mri_track.reference import mri_track_ref
from plugins.head_sums.reference import head_sums_ref
from plugins.table_positions.reference import table_positions_layers_ref, table_positions_ref
from plugins.held_columns.reference import held_columns_ref
from plugins.compact_slots.reference import compact_slots_ref
from plugins.paged_attention.reference import _FLOAT_CODES, PagedFormat, dense_attention_cpu, paged_attention_ref
from plugins.residual_append.reference import residual_append_ref
from plugins.int4_linear.reference import Int4Weight, int4_linear_ref
from plugins.int8_linear.reference import int8_linear_ref
from plugins.rms_norm.reference import rms_norm_ref
from plugins.rotary.reference import rotary_ref

SCHEMAS = {
    "kv_write": "(Tensor k, Tensor v, Tensor(a!)[] slot_fields, Tensor(b!)[] group_fields, Tensor(c!) k_group, "
                "Tensor pages, Tensor slots, int gid, int fmt_code, float scale_k, float scale_v) -> ()",
    "kv_write_groups": "(Tensor k, Tensor v, Tensor(a!)[] slot_fields, Tensor(b!)[] group_fields, Tensor(c!) k_group, "
                       "Tensor pages, Tensor slots, Tensor gids, int fmt_code, float scale_k, float scale_v) -> ()",
    "paged_attention": "(Tensor q, Tensor[] slot_fields, Tensor[] group_fields, Tensor k_group, Tensor valid_bits, "
                       "Tensor block_table, int fmt_code, float sm_scale, float scale_k, float scale_v, "
                       "bool return_logits) -> (Tensor, Tensor, Tensor)",
    "kmeans_select": "(Tensor keys, Tensor counts, Tensor k_keep, int iters) -> Tensor",
    "lowest_victim": "(Tensor scores, Tensor positions, Tensor blocked) -> Tensor",
    "table_victims": "(Tensor data, Tensor rows, Tensor positions, Tensor bound, int layer0) -> Tensor",
    "scatter_add_rows": "(Tensor(a!) data, Tensor rows, Tensor positions, Tensor values, int layer0) -> ()",
    "fold_add_rows": "(Tensor(a!) data, Tensor rows, Tensor[] positions, Tensor[] values, Tensor divisor, int layer) "
                     "-> ()",
    "finite_rows": "(Tensor[] values) -> Tensor",
    "head_sums": "(Tensor logits, Tensor lse) -> Tensor",
    "table_positions": "(Tensor slot_pos, Tensor block_table) -> (Tensor, Tensor)",
    "table_positions_layers": "(Tensor slot_pos, Tensor[] block_tables) -> (Tensor, Tensor)",
    "held_columns": "(Tensor where, Tensor rows, int n) -> Tensor",
    "compact_slots": "(Tensor(a!)[] slot_fields, Tensor(b!) k_group, Tensor(c!) valid, Tensor(d!) live, "
                     "Tensor(e!) hwm, Tensor(f!) slot_pos, Tensor(g!) slot_seg, Tensor pages, Tensor lens, "
                     "Tensor(h!) out_tokens, Tensor(i!) out_lists) -> ()",
    "gather_rows": "(Tensor data, Tensor rows, Tensor positions, int layer0) -> Tensor",
    "gather_keys": "(Tensor[] slot_fields, Tensor[] group_fields, Tensor k_group, Tensor flat, int fmt_code, "
                   "float scale_k) -> Tensor",
    "mri_track": "(Tensor(a!) ts, Tensor(b!) mri, int layer, Tensor rows, Tensor positions, Tensor[] values, "
                 "float divisor, float alpha, Tensor prompt, Tensor step) -> ()",
    "residual_append": "(Tensor(a!) arena_k, Tensor(b!) arena_v, Tensor at, Tensor k, Tensor v) -> ()",
    "buffer_attention": "(Tensor q, Tensor arena_k, Tensor arena_v, Tensor rows, int layer, Tensor counts, "
                        "float sm_scale, Tensor(a!) out, Tensor(b!) lse) -> ()",
    "int8_linear": "(Tensor x, Tensor codes_b, Tensor scales) -> Tensor",
    "int4_linear": "(Tensor x, Tensor codes_b, Tensor scales_b, Tensor mins_b, int n) -> Tensor",
}
# torch.ops.trtkv_cpu: the ops a compiled program calls on CPU tensors (``program_ops``). Loading the compiled CPU
# kernels registers them as these ops' CPU kernels in C++ (plugins/cpu_kernels/csrc/registrations.cpp), which the
# dispatcher calls without entering Python; until then, or where they did not build, the Python entry points below
# run (CompositeExplicitAutograd: any device).
PROGRAM_OPS = ("kv_write", "paged_attention", "residual_append", "buffer_attention", "int8_linear", "int4_linear")
_lib = torch.library.Library("trtkv", "DEF")
_cpu_lib = torch.library.Library("trtkv_cpu", "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)
    if _name in PROGRAM_OPS:
        _cpu_lib.define(_name + _schema)

def residual_append(arena_k: torch.Tensor, arena_v: torch.Tensor, at: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """Store ``k, v [b, H, D]`` at flat rows ``at`` of the residual arena (see residual_append/reference.py)."""
    if (k.dtype == v.dtype == torch.float32 and k.dim() == v.dim() == 3 and k.stride(2) == v.stride(2) == 1
            and k.stride(1) == v.stride(1) == k.shape[2] and use_cpu_kernels(arena_k)):
        from plugins.cpu_kernels.ops import residual_append_cpu

        residual_append_cpu(arena_k, arena_v, at, k, v)
        return
    residual_append_ref(arena_k, arena_v, at, k, v)


GEMV_MAX_ROWS = 16  # more rows (a prefill) multiply faster as one dense GEMM over the widened codes


def int8_linear(x: torch.Tensor, codes_b: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (codes * scales[:, None]).T`` for codes blocked by ``block_codes`` (see
    int8_linear/reference.py): the compiled CPU kernel for the few rows of a decode step, else the reference
    (a dense GEMM over the widened codes)."""
    if (x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
            and codes_b.dtype == torch.int8 and codes_b.is_contiguous() and use_cpu_kernels(x)):
        from plugins.cpu_kernels.ops import int8_linear_cpu

        return int8_linear_cpu(x.contiguous(), codes_b, scales)
    return int8_linear_ref(x, codes_b, scales)


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """``x [M, K] @ w.T`` for group-scaled int4 codes (see int4_linear/reference.py): the compiled CPU kernel for
    the few rows of a decode step, else the reference (a dense GEMM over the widened codes)."""
    if x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and use_cpu_kernels(x):
        from plugins.cpu_kernels.ops import int4_linear_cpu

        return int4_linear_cpu(x.contiguous(), w)
    return int4_linear_ref(x, w)


def _int4_linear_op(x, codes_b, scales_b, mins_b, n):
    return int4_linear(x, Int4Weight(codes_b, scales_b, mins_b, n))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalization of ``x [..., C]`` (see rms_norm/reference.py). The compiled CPU kernel takes plain fp32
    CPU rows in eager mode; torch.compile and export trace the reference (fake or functional tensors)."""
    if (type(x) is torch.Tensor and x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
            and weight.dim() == 1 and weight.is_contiguous() and not torch.compiler.is_compiling()
            and use_cpu_kernels(x)):
        from plugins.cpu_kernels.ops import rms_norm_cpu

        return rms_norm_cpu(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [T, heads, D]`` (see rotary/reference.py). The compiled CPU kernel takes plain
    fp32 CPU tensors in eager mode; torch.compile and export trace the reference (they hold fake or functional
    tensors, subclasses of Tensor)."""
    if (type(x) is torch.Tensor and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 3
            and x.shape[2] % 2 == 0 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cos.shape == sin.shape == (x.shape[0], x.shape[2]) and cos.is_contiguous() and sin.is_contiguous()
            and not torch.compiler.is_compiling() and use_cpu_kernels(x)):
        from plugins.cpu_kernels.ops import rotary_cpu

        return rotary_cpu(x, cos, sin)
    return rotary_ref(x, cos, sin)


def kv_write(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v) -> None:
    """Quantize, pack and scatter ``k, v [n, H, D]`` into ``(pages, slots)`` (see kv_write/reference.py)."""
    impl = kernel_impl(k)
    if impl == "triton":
        from plugins.kv_write.triton_kernel import kv_write_triton

        kv_write_triton(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v)
    elif impl == "cpu":
        from plugins.cpu_kernels.ops import kv_write_cpu

        kv_write_cpu(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v)
    else:
        kv_write_ref(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v)


def kv_write_groups(k, v, slot_fields, group_fields, k_group, pages, slots, gids, fmt_code, scale_k, scale_v) -> None:
    """``G`` flush groups at once (``k, v [G, n, H, D]``, ``pages, slots [G, n]``, ``gids [G]``; see
    kv_write/reference.py): a batch's flushes in one layer cost one call, not one per request. The compiled
    CPU kernel and the Triton kernel take them in one call; the reference writes each group in turn."""
    impl = kernel_impl(k)
    if impl == "triton":
        from plugins.kv_write.triton_kernel import kv_write_groups_triton

        kv_write_groups_triton(k, v, slot_fields, group_fields, k_group, pages, slots, gids, fmt_code, scale_k,
                               scale_v)
        return
    if impl == "cpu":
        from plugins.cpu_kernels.ops import kv_write_groups_cpu

        kv_write_groups_cpu(k, v, slot_fields, group_fields, k_group, pages, slots, gids, fmt_code, scale_k, scale_v)
        return
    kv_write_groups_ref(k, v, slot_fields, group_fields, k_group, pages, slots, gids, fmt_code, scale_k, scale_v)


def paged_attention(q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code, sm_scale, scale_k,
                    scale_v, return_logits, dense_run=None):
    """Decode attention over one format's pages: ``(out, lse, logits)`` (see paged_attention/reference.py).

    ``dense_run=(first_page, n)`` (Python callers only) promises that the single sequence's live tokens
    are slots ``0..n-1`` of the ascending page run starting at ``first_page``; the CPU reference then
    reads a view of the pool instead of gathering. The compiled CPU kernel ignores it: it reads pages in
    place anyway (measured faster at 128 tokens; longer contexts: see docs/benchmarks.md, "CPU kernels")."""
    args = (q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code, sm_scale, scale_k, scale_v,
            return_logits)
    impl = kernel_impl(q)
    if impl == "triton":
        from plugins.paged_attention.triton_kernel import paged_attention_triton

        return paged_attention_triton(*args)
    if impl == "cpu":
        from plugins.cpu_kernels.ops import paged_attention_cpu

        return paged_attention_cpu(*args)
    if dense_run is not None and not return_logits and q.device.type == "cpu" and fmt_code in _FLOAT_CODES:
        return dense_attention_cpu(q, slot_fields, dense_run, sm_scale)
    return paged_attention_ref(*args)


def paged_attention_formats(q: torch.Tensor, sources: list[PagedFormat], sm_scale: float, return_logits: bool,
                            dense_run=None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Decode attention over a layer's pages in one or more formats: ``(parts, logits)``, partials
    ``(out, lse)`` to merge by log-sum-exp and their logits (side by side in the sources' order). Triton: one
    launch for up to three formats, merged inside it (one part); elsewhere one ``paged_attention`` call a format
    (one part each, merged by the caller in the order it always has been). ``dense_run`` is a promise about
    the first source only (see ``paged_attention``)."""
    if kernel_impl(q) == "triton":
        from plugins.paged_attention.triton_kernel import paged_attention_formats_triton

        out, lse, logits = paged_attention_formats_triton(q, sources, sm_scale, return_logits)
        return [(out, lse)], [logits]
    parts, logits = [], []
    for i, s in enumerate(sources):
        out, lse, lg = paged_attention(q, s.slot_fields, s.group_fields, s.k_group, s.valid_bits, s.block_table,
                                       s.fmt_code, sm_scale, s.scale_k, s.scale_v, return_logits,
                                       dense_run if i == 0 else None)
        parts.append((out, lse))
        logits.append(lg)
    return parts, logits


def kmeans_select(keys, counts, k_keep, iters):
    """Per job, the rows k-means keeps (see kmeans_select/reference.py)."""
    impl = kernel_impl(keys)
    if impl == "triton":
        from plugins.kmeans_select.triton_kernel import kmeans_select_triton

        return kmeans_select_triton(keys, counts, k_keep, iters)
    if impl == "cpu":
        from plugins.cpu_kernels.ops import kmeans_select_cpu

        return kmeans_select_cpu(keys, counts, k_keep, iters)
    return kmeans_select_ref(keys, counts, k_keep, iters)


def lowest_victim(scores: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """Per row, the position of the lowest-scored free column, -1 none (see lowest_victim/reference.py): the
    compiled CPU kernel on CPU, else the reference (a few tensor passes, on any device)."""
    if use_cpu_kernels(scores):
        from plugins.cpu_kernels.ops import lowest_victim_cpu

        return lowest_victim_cpu(scores, positions, blocked)
    return lowest_victim_ref(scores, positions, blocked)


def scatter_add_rows(data: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                     layer0: int = 0) -> None:
    """Add a batch's per-position values into a score table in place (see scatter_add_rows/reference.py): the
    compiled CPU kernel for a float32 or float64 table on CPU, else the reference."""
    if data.dtype in (torch.float32, torch.float64) and data.is_contiguous() and use_cpu_kernels(data):
        from plugins.cpu_kernels.ops import scatter_add_rows_cpu

        scatter_add_rows_cpu(data, rows, positions, values, layer0)
        return
    scatter_add_rows_ref(data, rows, positions, values, layer0)


def fold_add_rows(data: torch.Tensor, rows: torch.Tensor, positions: list[torch.Tensor], values: list[torch.Tensor],
                  divisor: torch.Tensor, layer: int) -> None:
    """Add every layer's values of a batch, divided per request, into one layer of a score table in place, layer by
    layer (see scatter_add_rows/reference.py): the compiled CPU kernel for a float32 or float64 table on CPU, else
    the reference."""
    if data.dtype in (torch.float32, torch.float64) and data.is_contiguous() and use_cpu_kernels(data):
        from plugins.cpu_kernels.ops import fold_add_rows_cpu

        fold_add_rows_cpu(data, rows, positions, values, divisor, layer)
        return
    fold_add_rows_ref(data, rows, positions, values, divisor, layer)


def finite_rows(values: list[torch.Tensor]) -> torch.Tensor:
    """Whether each row of each ``[b, n]`` block of evidence is all finite, ``[len(values), b]`` bool on the host
    (see scatter_add_rows/reference.py): the compiled CPU kernel for CPU blocks, else the reference."""
    if values and use_cpu_kernels(values[0]):
        from plugins.cpu_kernels.ops import finite_rows_cpu

        return finite_rows_cpu(values)
    return finite_rows_ref(values)


def gather_keys(slot_fields, group_fields, k_group: torch.Tensor, flat: torch.Tensor, fmt_code: int,
                scale_k: float) -> torch.Tensor:
    """``[m, H, D]`` fp32 keys of one pool's slots ``flat`` (page * B + slot), dequantized (see
    gather_keys/reference.py): the compiled CPU kernel on CPU, else the reference (a gather and the format's
    decoder)."""
    if use_cpu_kernels(flat):
        from plugins.cpu_kernels.ops import gather_keys_cpu

        return gather_keys_cpu(slot_fields, group_fields, k_group, flat, fmt_code, scale_k)
    return gather_keys_ref(slot_fields, group_fields, k_group, flat, fmt_code, scale_k)


def table_victims(data: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, bound: torch.Tensor,
                  layer0: int = 0) -> torch.Tensor:
    """Per layer and row, the lowest-scored position below ``bound`` read from a score table, -1 none (see
    table_victims/reference.py): the compiled CPU kernel on CPU, else the reference."""
    if use_cpu_kernels(data):
        from plugins.cpu_kernels.ops import table_victims_cpu

        return table_victims_cpu(data, rows, positions, bound, layer0)
    return table_victims_ref(data, rows, positions, bound, layer0)


def gather_rows(data: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, layer0: int = 0) -> torch.Tensor:
    """A batch's per-position values read from a score table in every layer (see gather_rows/reference.py): the
    compiled CPU kernel for a contiguous float32, float64 or int32 table on CPU, else the reference."""
    if data.dtype in (torch.float32, torch.float64, torch.int32) and data.is_contiguous() and use_cpu_kernels(data):
        from plugins.cpu_kernels.ops import gather_rows_cpu

        return gather_rows_cpu(data, rows, positions, layer0)
    return gather_rows_ref(data, rows, positions, layer0)


def head_sums(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A decode step's attention weights summed over query heads, ``[b, n]`` (see head_sums/reference.py): the
    compiled CPU kernel on CPU, else the reference."""
    if use_cpu_kernels(logits):
        from plugins.cpu_kernels.ops import head_sums_cpu

        return head_sums_cpu(logits, lse)
    return head_sums_ref(logits, lse)


def compact_slots(slot_fields: list[torch.Tensor], k_group: torch.Tensor, valid: torch.Tensor, live: torch.Tensor,
                  hwm: torch.Tensor, slot_pos: torch.Tensor, slot_seg: torch.Tensor, pages: torch.Tensor,
                  lens: torch.Tensor, out_tokens: torch.Tensor, out_lists: torch.Tensor) -> None:
    """Move each page list's live tokens to the front of its pages, codes and slot state in place (see
    compact_slots/reference.py): the compiled CPU kernel for a pool on CPU, else the reference."""
    if use_cpu_kernels(k_group) and all(t.is_cpu for t in slot_fields):
        from plugins.cpu_kernels.ops import compact_slots_cpu

        compact_slots_cpu(slot_fields, k_group, valid, live, hwm, slot_pos, slot_seg, pages, lens, out_tokens,
                          out_lists)
        return
    compact_slots_ref(slot_fields, k_group, valid, live, hwm, slot_pos, slot_seg, pages, lens, out_tokens, out_lists)


def table_positions(slot_pos: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token position behind every column of a layer's paged-attention logits, ``[b, P * B]``, and each row's
    held count ``[b]`` (see table_positions/reference.py): the compiled CPU kernel on CPU, else the reference."""
    if slot_pos.dtype == torch.int64 and slot_pos.is_contiguous() and use_cpu_kernels(slot_pos):
        from plugins.cpu_kernels.ops import table_positions_cpu

        return table_positions_cpu(slot_pos, block_table)
    return table_positions_ref(slot_pos, block_table)


def table_positions_layers(slot_pos: torch.Tensor, block_tables: list[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``table_positions`` of every layer at once (``slot_pos [L, cap, B]``, one table ``[b, P]`` a layer) ->
    ``([L, b, P * B], [L, b])`` (see table_positions/reference.py): the compiled CPU kernel on CPU, else the
    reference."""
    if slot_pos.dtype == torch.int64 and slot_pos.is_contiguous() and use_cpu_kernels(slot_pos):
        from plugins.cpu_kernels.ops import table_positions_layers_cpu

        return table_positions_layers_cpu(slot_pos, block_tables)
    return table_positions_layers_ref(slot_pos, block_tables)


def held_columns(where: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The held columns of a batch's position-map rows in every layer, ascending, ``[layers, k, n]`` (see
    held_columns/reference.py): the compiled CPU kernel for a contiguous int32 map on CPU, else the reference."""
    if where.dtype == torch.int32 and where.is_contiguous() and use_cpu_kernels(where):
        from plugins.cpu_kernels.ops import held_columns_cpu

        return held_columns_cpu(where, rows, n)
    return held_columns_ref(where, rows, n)


def mri_track(ts: torch.Tensor, mri: torch.Tensor, layer: int, rows: torch.Tensor, positions: torch.Tensor,
              values: list[torch.Tensor], divisor: float, alpha: float, prompt: torch.Tensor,
              step: torch.Tensor) -> None:
    """LazyEviction's tracking update of a batch in one layer (positions ``[b, n]``) or in layers ``layer..`` (``[L, b,
    n]``), a token activated where ``values / divisor >= alpha``, in place (see mri_track/reference.py): the compiled
    CPU kernel for contiguous int32 tables on CPU, else the reference."""
    if ts.dtype == mri.dtype == torch.int32 and ts.is_contiguous() and mri.is_contiguous() and use_cpu_kernels(ts) \
            and all(v.dtype == torch.float32 for v in values):
        from plugins.cpu_kernels.ops import mri_track_cpu

        mri_track_cpu(ts, mri, layer, rows, positions, values, divisor, alpha, prompt, step)
        return
    mri_track_ref(ts, mri, layer, rows, positions, values, divisor, alpha, prompt, step)


def buffer_attention(q, arena_k, arena_v, rows, layer, counts, sm_scale, out, lse) -> None:
    """Merge attention over the residual buffers into the pages' ``out``/``lse`` in place
    (see buffer_attention/reference.py)."""
    if use_cpu_kernels(q):
        from plugins.cpu_kernels.ops import buffer_attention_cpu

        buffer_attention_cpu(q, arena_k, arena_v, rows, layer, counts, sm_scale, out, lse)
        return
    o, s = buffer_attention_ref(q, arena_k, arena_v, rows, layer, counts, sm_scale, out, lse)
    out.copy_(o)
    lse.copy_(s)


def _paged_attention_meta(q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code, sm_scale, scale_k,
                          scale_v, return_logits):
    b, Hq, D = q.shape
    n = block_table.shape[1] * slot_fields[0].shape[1] if return_logits else 0
    out = q.new_empty((b, Hq, D), dtype=torch.float32)
    lse = q.new_empty((b, Hq), dtype=torch.float32)
    logits = q.new_empty((b, Hq, n) if return_logits else (0,), dtype=torch.float32)
    return out, lse, logits


def _int8_linear_meta(x, codes_b, scales):
    return x.new_empty((x.shape[0], scales.shape[0]), dtype=torch.float32)


def _int4_linear_meta(x, codes_b, scales_b, mins_b, n):
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


def _kmeans_fake(keys, counts, k_keep, iters):
    width = torch.library.get_ctx().new_dynamic_size()  # max(k_keep): data-dependent
    return keys.new_empty((keys.shape[0], width), dtype=torch.int64)


_PYTHON_KERNELS = {"kv_write": kv_write, "kv_write_groups": kv_write_groups, "paged_attention": paged_attention,
                   "kmeans_select": kmeans_select, "lowest_victim": lowest_victim, "table_victims": table_victims,
                   "scatter_add_rows": scatter_add_rows, "fold_add_rows": fold_add_rows, "mri_track": mri_track,
                   "finite_rows": finite_rows,
                   "head_sums": head_sums,
                   "table_positions": table_positions, "table_positions_layers": table_positions_layers,
                   "held_columns": held_columns, "compact_slots": compact_slots,
                   "gather_rows": gather_rows, "gather_keys": gather_keys,
                   "buffer_attention": buffer_attention,
                   "residual_append": residual_append, "int8_linear": int8_linear, "int4_linear": _int4_linear_op}
_META_KERNELS = {"kv_write": lambda *a: None, "kv_write_groups": lambda *a: None, "residual_append": lambda *a: None,
                 "scatter_add_rows": lambda *a: None, "fold_add_rows": lambda *a: None, "mri_track": lambda *a: None,
                 "compact_slots": lambda *a: None,
                 "buffer_attention": lambda *a: None, "paged_attention": _paged_attention_meta,
                 "int8_linear": _int8_linear_meta, "int4_linear": _int4_linear_meta,
                 "lowest_victim": lambda scores, positions, blocked: positions.new_empty(positions.shape[:1]),
                 "table_victims": lambda data, rows, positions, bound, layer0: positions.new_empty(positions.shape[:2]),
                 "gather_rows": lambda data, rows, positions, layer0: data.new_empty(positions.shape),
                 "held_columns": lambda where, rows, n: rows.new_empty((where.shape[0], rows.shape[0], n),
                                                                       dtype=torch.int64),
                 "table_positions_layers": lambda slot_pos, block_tables: (slot_pos.new_empty(
                     (slot_pos.shape[0], block_tables[0].shape[0], block_tables[0].shape[1] * slot_pos.shape[2])),
                     slot_pos.new_empty((slot_pos.shape[0], block_tables[0].shape[0]))),
                 "table_positions": lambda slot_pos, block_table: (slot_pos.new_empty(
                     (block_table.shape[0], block_table.shape[1] * slot_pos.shape[1])),
                     slot_pos.new_empty(block_table.shape[:1])),
                 "head_sums": lambda logits, lse: logits.new_empty((logits.shape[0], logits.shape[2]),
                                                                   dtype=torch.float32),
                 "finite_rows": lambda values: values[0].new_empty((len(values), values[0].shape[0]), dtype=torch.bool)}
for _name, _kernel in _PYTHON_KERNELS.items():
    for _key in ("CPU", "CUDA"):
        _lib.impl(_name, _kernel, _key)
    if _name in PROGRAM_OPS:
        _cpu_lib.impl(_name, _kernel, "CompositeExplicitAutograd")
for _name, _kernel in _META_KERNELS.items():
    _lib.impl(_name, _kernel, "Meta")
    if _name in PROGRAM_OPS:
        _cpu_lib.impl(_name, _kernel, "Meta")
torch.library.register_fake("trtkv::kmeans_select", _kmeans_fake, lib=_lib)


def program_ops(t: torch.Tensor):
    """The op namespace a compiled program (``torch.compile``: the graph runtime) calls for tensors like ``t``,
    chosen while it traces (``t.is_cpu`` is static there): on CPU ``torch.ops.trtkv_cpu``, the compiled kernels
    registered in C++ once ``load_program_ops`` has loaded them; elsewhere ``torch.ops.trtkv``."""
    return torch.ops.trtkv_cpu if t.is_cpu else torch.ops.trtkv


def reserve_graph_state(device: torch.device) -> None:
    """Allocate the kernels' persistent device buffers (the Triton paged attention's split-merge tickets) now,
    before a CUDA graph is recorded: allocated during a recording's warm-up they would live in its memory pool."""
    if device.type == "cuda":
        from plugins.paged_attention.triton_kernel import reserve_counters

        reserve_counters(device)


def load_program_ops(t: torch.Tensor) -> bool:
    """Load the compiled CPU kernels (their module registers ``torch.ops.trtkv_cpu``'s C++ kernels) before a
    program on ``t``'s device runs; False where they did not build or are not chosen (``TRTKV_KERNELS``), in which
    case those ops run the Python entry points."""
    return use_cpu_kernels(t)
