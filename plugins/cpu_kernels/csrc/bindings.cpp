// Python bindings of the CPU kernels (loaded by plugins/cpu_kernels/build.py).
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &trtkv::paged_attention_cpu, "paged decode attention over packed pages (CPU)");
  m.def("kv_write", &trtkv::kv_write_cpu, "quantize, pack and scatter K/V into pages (CPU)");
  m.def("kv_write_groups", &trtkv::kv_write_groups_cpu,
        "kv_write of G flush groups of n tokens each, group j's key scales to arena entry gids[j] (CPU)");
  m.def("buffer_attention_merge", &trtkv::buffer_attention_merge_cpu,
        "attention over the residual buffers, merged into the pages' (out, lse) in place (CPU)");
  m.def("kmeans_select", &trtkv::kmeans_select_cpu, "batched k-means token selection (CPU)");
  m.def("lowest_victim", &trtkv::lowest_victim_cpu, "the lowest-scored free column of each row, ties to the oldest (CPU)");
  m.def("table_victims", &trtkv::table_victims_cpu,
        "the lowest-scored unprotected position of each row, its scores read from a score table (CPU)");
  m.def("scatter_add_rows", &trtkv::scatter_add_rows_cpu,
        "a batch's per-position evidence added into a score table in every layer, in place (CPU)");
  m.def("fold_add_rows", &trtkv::fold_add_rows_cpu,
        "every layer's per-position evidence of a batch, divided per request, added into one layer of a score "
        "table in layer order, in place (CPU)");
  m.def("finite_rows", &trtkv::finite_rows_cpu, "whether each row of each [b, n] block is all finite (CPU)");
  m.def("gather_keys", &trtkv::gather_keys_cpu, "the asked slots' keys of one pool, dequantized to fp32 (CPU)");
  m.def("gather_rows", &trtkv::gather_rows_cpu,
        "a batch's per-position values read from a score table in every layer (CPU)");
  m.def("head_sums", &trtkv::head_sums_cpu,
        "a decode step's attention weights summed over query heads, from logits and log-sum-exps (CPU)");
  m.def("table_positions", &trtkv::table_positions_cpu,
        "the token position behind every column of a layer's paged-attention logits, and each row's held count (CPU)");
  m.def("table_positions_layers", &trtkv::table_positions_layers_cpu,
        "table_positions of every layer at once, one block table a layer (CPU)");
  m.def("compact_slots", &trtkv::compact_slots_cpu,
        "each page list's live tokens moved to the front of its pages, codes and slot state, in place (CPU)");
  m.def("held_columns", &trtkv::held_columns_cpu,
        "the held columns of a batch's position-map rows in every layer, ascending (CPU)");
  m.def("mri_track", &trtkv::mri_track_cpu,
        "LazyEviction's tracking update of a batch in one layer or several, in place (CPU)");
  m.def("residual_append", &trtkv::residual_append_cpu, "a decode step's K/V rows into the residual arena (CPU)");
  m.def("rms_norm", &trtkv::rms_norm_cpu, "RMS normalization of fp32 rows (CPU)");
  m.def("rotary", &trtkv::rotary_cpu, "rotary position embedding of fp32 heads (CPU)");
  m.def("int4_linear", &trtkv::int4_linear_cpu,
        "x @ (int4 codes, two a byte, blocked by 64 output channels, x group scales + mins).T, fp32 rows (CPU)");
  m.def("int8_linear", &trtkv::int8_linear_cpu, "x @ (int8 codes blocked by 64 output channels x per-channel scales).T, fp32 rows (CPU)");
}
