// Python bindings of the CPU kernels (loaded by plugins/cpu_kernels/build.py).
#include <torch/extension.h>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &trtkv::paged_attention_cpu, "paged decode attention over packed pages (CPU)");
  m.def("kv_write", &trtkv::kv_write_cpu, "quantize, pack and scatter K/V into pages (CPU)");
  m.def("kv_write_groups", &trtkv::kv_write_groups_cpu,
        "kv_write of G flush groups of n tokens each, group j's key scales to arena entry gids[j] (CPU)");
  m.def("buffer_attention_merge", &trtkv::buffer_attention_merge_cpu,
        "attention over the residual buffers, merged into the pages' (out, lse) in place (CPU)");
  m.def("kmeans_select", &trtkv::kmeans_select_cpu, "batched k-means token selection (CPU)");
  m.def("residual_append", &trtkv::residual_append_cpu, "a decode step's K/V rows into the residual arena (CPU)");
  m.def("rms_norm", &trtkv::rms_norm_cpu, "RMS normalization of fp32 rows (CPU)");
  m.def("rotary", &trtkv::rotary_cpu, "rotary position embedding of fp32 heads (CPU)");
  m.def("int4_linear", &trtkv::int4_linear_cpu,
        "x @ (int4 codes, two a byte, blocked by 64 output channels, x group scales + mins).T, fp32 rows (CPU)");
  m.def("int8_linear", &trtkv::int8_linear_cpu, "x @ (int8 codes blocked by 64 output channels x per-channel scales).T, fp32 rows (CPU)");
}
