// The compiled CPU kernels' entry points (one per .cpp), bound to Python (bindings.cpp) and registered as
// torch.ops.trtkv_cpu.* (registrations.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace trtkv {
std::vector<at::Tensor> paged_attention_cpu(const at::Tensor& q, const std::vector<at::Tensor>& slot_fields,
                                            const std::vector<at::Tensor>& group_fields, const at::Tensor& k_group,
                                            const at::Tensor& valid_bits, const at::Tensor& block_table,
                                            int64_t fmt_code, double sm_scale, double scale_k, double scale_v,
                                            bool return_logits, int64_t num_splits);
void kv_write_cpu(const at::Tensor& k, const at::Tensor& v, const std::vector<at::Tensor>& slot_fields,
                  const std::vector<at::Tensor>& group_fields, const at::Tensor& k_group, const at::Tensor& pages,
                  const at::Tensor& slots, int64_t gid, int64_t fmt_code, double scale_k, double scale_v);
void kv_write_groups_cpu(const at::Tensor& k, const at::Tensor& v, const std::vector<at::Tensor>& slot_fields,
                         const std::vector<at::Tensor>& group_fields, const at::Tensor& k_group,
                         const at::Tensor& pages, const at::Tensor& slots, const at::Tensor& gids, int64_t fmt_code,
                         double scale_k, double scale_v);
void buffer_attention_merge_cpu(const at::Tensor& q, const at::Tensor& arena_k, const at::Tensor& arena_v,
                                const at::Tensor& rows, int64_t layer, const at::Tensor& counts, double sm_scale,
                                at::Tensor& out, at::Tensor& lse);
void scatter_add_rows_cpu(at::Tensor& data, const at::Tensor& rows, const at::Tensor& positions,
                          const at::Tensor& values, int64_t layer0);
void fold_add_rows_cpu(at::Tensor& data, const at::Tensor& rows, const std::vector<at::Tensor>& positions,
                       const std::vector<at::Tensor>& values, const at::Tensor& divisor, int64_t layer);
at::Tensor finite_rows_cpu(const std::vector<at::Tensor>& values);
void mri_track_cpu(at::Tensor& ts, at::Tensor& mri, int64_t layer, const at::Tensor& rows, const at::Tensor& positions,
                   const std::vector<at::Tensor>& values, double divisor, double alpha, const at::Tensor& prompt,
                   const at::Tensor& step);
at::Tensor gather_rows_cpu(const at::Tensor& data, const at::Tensor& rows, const at::Tensor& positions,
                           int64_t layer0);
at::Tensor head_sums_cpu(const at::Tensor& logits, const at::Tensor& lse);
std::tuple<at::Tensor, at::Tensor> table_positions_cpu(const at::Tensor& slot_pos, const at::Tensor& block_table);
std::tuple<at::Tensor, at::Tensor> table_positions_layers_cpu(const at::Tensor& slot_pos,
                                                              const std::vector<at::Tensor>& block_tables);
void compact_slots_cpu(const std::vector<at::Tensor>& slot_fields, at::Tensor& k_group, at::Tensor& valid,
                       at::Tensor& live, at::Tensor& hwm, at::Tensor& slot_pos, at::Tensor& slot_seg,
                       const at::Tensor& pages, const at::Tensor& lens, at::Tensor& out_tokens,
                       at::Tensor& out_lists);
at::Tensor held_columns_cpu(const at::Tensor& where, const at::Tensor& rows, int64_t n);
at::Tensor lowest_victim_cpu(const at::Tensor& scores, const at::Tensor& positions, const at::Tensor& blocked);
at::Tensor table_victims_cpu(const at::Tensor& data, const at::Tensor& rows, const at::Tensor& positions,
                             const at::Tensor& bound, int64_t layer0);
at::Tensor gather_keys_cpu(const std::vector<at::Tensor>& slot_fields, const std::vector<at::Tensor>& group_fields,
                           const at::Tensor& k_group, const at::Tensor& flat, int64_t fmt_code, double scale_k);
at::Tensor kmeans_select_cpu(const at::Tensor& keys, const at::Tensor& counts, const at::Tensor& k_keep,
                             int64_t iters);
void residual_append_cpu(at::Tensor& arena_k, at::Tensor& arena_v, const at::Tensor& at, const at::Tensor& k,
                         const at::Tensor& v);
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& codes_b, const at::Tensor& scales);
at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& codes_b, const at::Tensor& scales_b,
                           const at::Tensor& mins_b, int64_t n);
}  // namespace trtkv
