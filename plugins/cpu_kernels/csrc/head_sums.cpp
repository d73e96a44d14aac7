// CPU attention weights summed over query heads (contract: plugins/head_sums/reference.py).
//
// The reference subtracts, exponentiates and reduces [b, Hq, n] in three passes and writes the weights; here each
// request's row is one pass over its logits into an [n] accumulator, heads in order, with the branch-free
// exponential of the attention kernels (codecs.h::exp_neg, so the loop vectorizes).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "codecs.h"

namespace trtkv {

// 512-bit vectors where the CPU has them (GCC's default for -march=native on Xeons is 256): the loop is the
// exponential's arithmetic, so twice the lanes is nearly twice the speed
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=512")
at::Tensor head_sums_cpu(const at::Tensor& logits_in, const at::Tensor& lse_in) {
  TORCH_CHECK(logits_in.dim() == 3, "head_sums: logits must be [b, Hq, n]");
  TORCH_CHECK(lse_in.dim() == 2 && lse_in.size(0) == logits_in.size(0) && lse_in.size(1) == logits_in.size(1),
              "head_sums: lse must be [b, Hq], one per row and head of logits");
  const at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  const int64_t b = logits.size(0), Hq = logits.size(1), n = logits.size(2);
  at::Tensor out = at::zeros({b, n}, logits.options());
  const float* lg = logits.data_ptr<float>();
  const float* ls = lse.data_ptr<float>();
  float* o = out.data_ptr<float>();
  constexpr int64_t SERIAL_WORK = 1 << 15;  // logits below which no thread is woken
  const int64_t per_row = std::max<int64_t>(1, Hq * n);
  at::parallel_for(0, b, std::max<int64_t>(1, SERIAL_WORK / per_row), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* __restrict acc = o + i * n;
      for (int64_t h = 0; h < Hq; ++h) {
        const float l = ls[i * Hq + h];
        const float m = std::isinf(l) ? 0.0f : l;  // a row with no live key: its weights exp(-inf) = 0
        const float* __restrict row = lg + (i * Hq + h) * n;
        if (h == 0) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) acc[j] = exp_neg(row[j] - m);
        } else {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) acc[j] += exp_neg(row[j] - m);
        }
      }
    }
  });
  return out;
}
#pragma GCC pop_options

}  // namespace trtkv
