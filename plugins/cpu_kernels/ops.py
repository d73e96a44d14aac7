"""Python entry points of the compiled CPU kernels, with the same signatures as the torch references."""
from __future__ import annotations

from plugins.cpu_kernels.build import cpu_kernels


def paged_attention_cpu(q, slot_fields, group_fields, k_group, valid_bits, block_table, fmt_code, sm_scale, scale_k,
                        scale_v, return_logits, num_splits_override: int | None = None):
    """Same contract as ``paged_attention_ref``: ``(out [b,Hq,D] fp32, lse [b,Hq] fp32, logits)``.

    ``logits`` is ``[b, Hq, P*B]`` scaled logits in block-table order with -inf at dead slots and -1
    padding when ``return_logits``, else empty. Splits of one sequence's pages are merged inside the
    kernel (``num_splits_override``, else the kernel's own rule: only when the sequences alone cannot fill the
    threads); the result merges with other formats' partials through ``merge_partials`` as before."""
    out, lse, logits = cpu_kernels().paged_attention(
        q, list(slot_fields), list(group_fields), k_group, valid_bits, block_table, int(fmt_code), float(sm_scale),
        float(scale_k), float(scale_v), bool(return_logits), int(num_splits_override or 0))
    return out, lse, logits


def kv_write_cpu(k, v, slot_fields, group_fields, k_group, pages, slots, gid, fmt_code, scale_k, scale_v) -> None:
    """Same contract as ``kv_write_ref``: quantize ``k, v [n, H, D]`` and scatter into ``(pages, slots)``."""
    cpu_kernels().kv_write(k, v, list(slot_fields), list(group_fields), k_group, pages, slots, int(gid),
                           int(fmt_code), float(scale_k), float(scale_v))


def kv_write_groups_cpu(k, v, slot_fields, group_fields, k_group, pages, slots, gids, fmt_code, scale_k,
                        scale_v) -> None:
    """Same contract as ``kv_write_groups_ref``: ``G`` flush groups ``k, v [G, n, H, D]`` in one call."""
    cpu_kernels().kv_write_groups(k, v, list(slot_fields), list(group_fields), k_group, pages, slots, gids,
                                  int(fmt_code), float(scale_k), float(scale_v))


def kmeans_select_cpu(keys, counts, k_keep, iters):
    """Same contract as ``kmeans_select_ref``: ``[J, max(k_keep)]`` int64 kept rows, ascending, -1 padded."""
    return cpu_kernels().kmeans_select(keys, counts, k_keep, int(iters))


def lowest_victim_cpu(scores, positions, blocked):
    """Same contract as ``lowest_victim_ref``: ``[M]`` int64 victim positions, -1 none."""
    return cpu_kernels().lowest_victim(scores, positions, blocked)


def table_victims_cpu(data, rows, positions, bound, layer0):
    """Same contract as ``table_victims_ref``: ``[L, k]`` int64 victim positions, -1 none."""
    return cpu_kernels().table_victims(data, rows, positions, bound, int(layer0))


def scatter_add_rows_cpu(data, rows, positions, values, layer0) -> None:
    """Same contract as ``scatter_add_rows_ref``: adds into ``data`` in place."""
    cpu_kernels().scatter_add_rows(data, rows, positions, values, int(layer0))


def fold_add_rows_cpu(data, rows, positions, values, divisor, layer) -> None:
    """Same contract as ``fold_add_rows_ref``: adds into ``data`` in place."""
    cpu_kernels().fold_add_rows(data, rows, list(positions), list(values), divisor, int(layer))


def finite_rows_cpu(values):
    """Same contract as ``finite_rows_ref``: ``[len(values), b]`` bool."""
    return cpu_kernels().finite_rows(list(values))


def gather_keys_cpu(slot_fields, group_fields, k_group, flat, fmt_code, scale_k):
    """Same contract as ``gather_keys_ref``: ``[m, H, D]`` fp32 keys of the pool's slots ``flat``."""
    return cpu_kernels().gather_keys(list(slot_fields), list(group_fields), k_group, flat, int(fmt_code),
                                     float(scale_k))


def gather_rows_cpu(data, rows, positions, layer0):
    """Same contract as ``gather_rows_ref``: ``[L, b, n]`` of ``data``'s dtype."""
    return cpu_kernels().gather_rows(data, rows, positions, int(layer0))


def head_sums_cpu(logits, lse):
    """Same contract as ``head_sums_ref``: ``[b, n]`` fp32."""
    return cpu_kernels().head_sums(logits, lse)


def table_positions_cpu(slot_pos, block_table):
    """Same contract as ``table_positions_ref``: ``(positions [b, P * B], counts [b])`` int64."""
    return cpu_kernels().table_positions(slot_pos, block_table)


def table_positions_layers_cpu(slot_pos, block_tables):
    """Same contract as ``table_positions_layers_ref``: ``(positions [L, b, P * B], counts [L, b])`` int64."""
    return cpu_kernels().table_positions_layers(slot_pos, list(block_tables))


def compact_slots_cpu(slot_fields, k_group, valid, live, hwm, slot_pos, slot_seg, pages, lens, out_tokens,
                      out_lists) -> None:
    """Same contract as ``compact_slots_ref``: updates the pool and fills the outputs in place."""
    cpu_kernels().compact_slots(list(slot_fields), k_group, valid, live, hwm, slot_pos, slot_seg, pages, lens,
                                out_tokens, out_lists)


def held_columns_cpu(where, rows, n):
    """Same contract as ``held_columns_ref``: ``[layers, k, n]`` int64."""
    return cpu_kernels().held_columns(where, rows, int(n))


def mri_track_cpu(ts, mri, layer, rows, positions, values, divisor, alpha, prompt, step) -> None:
    """Same contract as ``mri_track_ref``: updates ``ts`` and ``mri`` in place."""
    cpu_kernels().mri_track(ts, mri, int(layer), rows, positions, list(values), float(divisor), float(alpha), prompt,
                            step)


def buffer_attention_cpu(q, arena_k, arena_v, rows, layer, counts, sm_scale, out, lse):
    """Same contract as ``buffer_attention_ref``; merges into ``out``/``lse`` in place and returns them."""
    cpu_kernels().buffer_attention_merge(q, arena_k, arena_v, rows, int(layer), counts, float(sm_scale), out, lse)
    return out, lse


def rms_norm_cpu(x, weight, eps):
    """Same contract as ``rms_norm_ref`` for fp32 ``x [T, C]`` (channels contiguous), bit-identical."""
    return cpu_kernels().rms_norm(x, weight, eps)


def rotary_cpu(x, cos, sin):
    """Same contract as ``rotary_ref`` for fp32 ``x [T, heads, D]`` (heads contiguous), bit-identical."""
    return cpu_kernels().rotary(x, cos, sin)


def residual_append_cpu(arena_k, arena_v, at, k, v) -> None:
    """Same contract as ``residual_append_ref`` for fp32 ``k, v [b, H, D]`` (heads contiguous)."""
    cpu_kernels().residual_append(arena_k, arena_v, at, k, v)


def int8_linear_cpu(x, codes_b, scales):
    """Same contract as ``int8_linear_ref`` for fp32 ``x [M, K]`` (contiguous)."""
    return cpu_kernels().int8_linear(x, codes_b, scales)


def int4_linear_cpu(x, w):
    """Same contract as ``int4_linear_ref`` for fp32 ``x [M, K]`` (contiguous) and an ``Int4Weight``."""
    return cpu_kernels().int4_linear(x, w.codes_b, w.scales_b, w.mins_b, int(w.n))
