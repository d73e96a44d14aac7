// The kernels as the CPU implementations of torch.ops.trtkv_cpu.* (schemas, fake kernels and the fallback for
// every other case: plugins/ops.py). A program compiled by inductor calls them through the dispatcher straight
// into C++: no Python frame, no Tensor[] boxed into Python lists, which is what a Python-registered op costs
// (~10 us a call, a few hundred calls a decode step).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <tuple>
#include <vector>

namespace trtkv {
namespace {

std::vector<at::Tensor> list(at::TensorList ts) { return std::vector<at::Tensor>(ts.begin(), ts.end()); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_attention_op(
    const at::Tensor& q, at::TensorList slot_fields, at::TensorList group_fields, const at::Tensor& k_group,
    const at::Tensor& valid_bits, const at::Tensor& block_table, int64_t fmt_code, double sm_scale, double scale_k,
    double scale_v, bool return_logits) {
  auto r = paged_attention_cpu(q, list(slot_fields), list(group_fields), k_group, valid_bits, block_table, fmt_code,
                               sm_scale, scale_k, scale_v, return_logits, 0);
  return {r[0], r[1], r[2]};
}

void kv_write_op(const at::Tensor& k, const at::Tensor& v, at::TensorList slot_fields, at::TensorList group_fields,
                 const at::Tensor& k_group, const at::Tensor& pages, const at::Tensor& slots, int64_t gid,
                 int64_t fmt_code, double scale_k, double scale_v) {
  kv_write_cpu(k, v, list(slot_fields), list(group_fields), k_group, pages, slots, gid, fmt_code, scale_k, scale_v);
}

void residual_append_op(at::Tensor arena_k, at::Tensor arena_v, const at::Tensor& at, const at::Tensor& k,
                        const at::Tensor& v) {
  residual_append_cpu(arena_k, arena_v, at, k.to(at::kFloat).contiguous(), v.to(at::kFloat).contiguous());
}

void buffer_attention_op(const at::Tensor& q, const at::Tensor& arena_k, const at::Tensor& arena_v,
                         const at::Tensor& rows, int64_t layer, const at::Tensor& counts, double sm_scale,
                         at::Tensor out, at::Tensor lse) {
  buffer_attention_merge_cpu(q, arena_k, arena_v, rows, layer, counts, sm_scale, out, lse);
}

// Any number of rows (the eager path hands more than a decode step's few to a dense GEMM instead).
at::Tensor int8_linear_op(const at::Tensor& x, const at::Tensor& codes_b, const at::Tensor& scales) {
  return int8_linear_cpu(x.to(at::kFloat).contiguous(), codes_b, scales);
}

at::Tensor int4_linear_op(const at::Tensor& x, const at::Tensor& codes_b, const at::Tensor& scales_b,
                          const at::Tensor& mins_b, int64_t n) {
  return int4_linear_cpu(x.to(at::kFloat).contiguous(), codes_b, scales_b, mins_b, n);
}

}  // namespace
}  // namespace trtkv

TORCH_LIBRARY_IMPL(trtkv_cpu, CPU, m) {
  m.impl("kv_write", &trtkv::kv_write_op);
  m.impl("paged_attention", &trtkv::paged_attention_op);
  m.impl("residual_append", &trtkv::residual_append_op);
  m.impl("buffer_attention", &trtkv::buffer_attention_op);
  m.impl("int8_linear", &trtkv::int8_linear_op);
  m.impl("int4_linear", &trtkv::int4_linear_op);
}
